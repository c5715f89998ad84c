"""A `streamrl up` job lives and dies with its supervisor: killed with SIGKILL, closed terminal
(SIGHUP), or Ctrl-C twice, it leaves no child running (generator, gateway worker, trainer,
embedded Valkey), each of which runs in a session of its own.

The job is the demo config on the tiny model with the transformers engine and far more steps than
the test waits for; the supervisor is signalled once every service is up (run.json names them and
the trainer answers), wherever the run has got to by then.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.pids import alive
from tests.support.redis import valkey_pid
from tests.support.runs import output_dir, write_run_config
from tests.support.services import start_job, wait_job_up

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


def _job_pids(out: Path) -> list[int]:
    """The children run.json names, and the embedded Valkey."""
    run = json.loads((out / "run.json").read_text())
    valkey = valkey_pid(run["redis_url"])
    assert valkey is not None, "the embedded Valkey is not running"
    return [c["pid"] for c in run["children"].values()] + [valkey]


def _start(tmp: Path, tiny_model_dir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    overrides = {"grpo.max_num_steps": 1000, "gym_gateway.drain_timeout_s": 5.0}
    config = write_run_config(tmp, tiny_model_dir, None, f"sig-{os.getpid()}-{tmp.name}", overrides)
    sup = start_job(config, tmp / "up.log")
    out = output_dir(config)
    wait_job_up(sup, out, tmp / "up.log", "/health")
    return sup, out


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def _cleanup(pids: list[int]) -> None:
    for p in pids:
        for kill in (os.killpg, os.kill):  # its session (engine subprocesses), then the process itself
            try:
                kill(p, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.parametrize("how", ["SIGKILL", "SIGHUP"])
def test_children_stop_when_the_supervisor_goes(tmp_path, tiny_model_dir, how):
    sup, out = _start(tmp_path, tiny_model_dir)
    pids = _job_pids(out)
    try:
        assert len(pids) == 4, pids  # generator, gateway worker, trainer, Valkey
        os.kill(sup.pid, getattr(signal, how))
        sup.wait(120)
        left = _wait_gone(pids, 120)  # each drains on its SIGTERM, bounded by its drain limit
        assert left == [], f"still running after the supervisor got {how}: {left}"
    finally:
        _cleanup(pids)
    if how == "SIGHUP":
        assert sup.returncode == 130 and "stopping the job" in (tmp_path / "up.log").read_text()


def test_a_second_ctrl_c_stops_the_job_at_once(tmp_path, tiny_model_dir):
    sup, out = _start(tmp_path, tiny_model_dir)
    pids = _job_pids(out)
    try:
        os.kill(sup.pid, signal.SIGINT)
        time.sleep(0.5)  # the first one is being handled: the trainer drains first
        os.kill(sup.pid, signal.SIGINT)
        sup.wait(60)
        assert _wait_gone(pids, 30) == []
    finally:
        _cleanup(pids)
    assert "stopping at once" in (tmp_path / "up.log").read_text()

"""A `streamrl up` job lives and dies with its supervisor: killed with SIGKILL, closed terminal
(SIGHUP), or Ctrl-C twice, it leaves no child running (generator, gateway worker, trainer,
embedded Valkey), each of which runs in a session of its own; nor, with a vLLM generator and a
trainer of two ranks, any grandchild (vLLM's engine core, torchrun's rank processes).

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


def _start(tmp: Path, tiny_model_dir: Path, **extra: object) -> tuple[subprocess.Popen[bytes], Path]:
    overrides = {"grpo.max_num_steps": 1000, "gym_gateway.drain_timeout_s": 5.0, **extra}
    config = write_run_config(tmp, tiny_model_dir, None, f"sig-{os.getpid()}-{tmp.name}", overrides)
    sup = start_job(config, tmp / "up.log")
    out = output_dir(config)
    wait_job_up(sup, out, tmp / "up.log", "/health")
    return sup, out


def _descendants(pids: list[int]) -> dict[int, str]:
    """Every process below ``pids`` (children, grandchildren, ...), with its command line."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found: dict[int, str] = {}
    frontier = set(pids)
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier and pid not in found}
        for pid in frontier:
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                found[pid] = ""
    return found


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


@pytest.mark.parametrize("how", ["SIGHUP"])  # SIGKILL: the engine-core and rank test below
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


def test_a_killed_supervisor_leaves_no_engine_core_and_no_trainer_rank(tmp_path, tiny_model_dir):
    """kill -9 of `streamrl up` with a vLLM generator and a trainer of two ranks under torchrun:
    the children get SIGTERM from the kernel (`streamrl.child_guard`) and take their own
    processes down with them, so no engine core and no rank is left."""
    sup, out = _start(tmp_path, tiny_model_dir, **{"policy.generation.backend": "vllm", "trainer.nproc_per_node": 2})
    pids = _job_pids(out)
    below = _descendants(pids)
    try:
        engine = [pid for pid, cmd in below.items() if "EngineCore" in cmd]
        ranks = [pid for pid, cmd in below.items() if "services.trainer" in cmd]
        assert engine and len(ranks) == 2, below  # the grandchildren the test is about are there
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(120)
        left = _wait_gone([*pids, *below], 150)
        assert left == [], {pid: below.get(pid, "a child") for pid in left}
    finally:
        _cleanup([*pids, *below])


def test_a_second_ctrl_c_stops_the_job_at_once(tmp_path, tiny_model_dir):
    sup, out = _start(tmp_path, tiny_model_dir)
    pids = _job_pids(out)
    try:
        os.kill(sup.pid, signal.SIGINT)
        log = tmp_path / "up.log"
        deadline = time.monotonic() + 60
        while "interrupted: stopping the job" not in log.read_text():  # the first one is being handled
            assert time.monotonic() < deadline, "the supervisor did not take the first Ctrl-C"
            time.sleep(0.05)
        os.kill(sup.pid, signal.SIGINT)  # while the trainer drains
        sup.wait(60)
        assert _wait_gone(pids, 30) == []
    finally:
        _cleanup(pids)
    assert "stopping at once" in (tmp_path / "up.log").read_text()

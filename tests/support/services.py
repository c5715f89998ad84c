"""Processes a test starts itself: a service (``python -m services.<name>``), a whole ``streamrl up``
job, or one ``streamrl`` command; the one launcher of every test that runs services as processes
(tests/e2e, tests/faults, tests/soak, and the process tests of tests/integration).

* `Service`: one service process in a process group of its own, on a port of its own, writing
  its log to a file; `Service.wait_ready` waits until it answers ``GET /ready`` (failing with its
  log if it exits first), and it is signalled, killed and stopped by pid.
* `start_job`: ``streamrl up CONFIG [key=value ...]`` in a session of its own (signals come from
  the test only); `wait_job_up` until its trainer answers.
* `streamrl`: one command of the command line, run to its end, its output captured.
* `make_data`: a dataset of the demo's ``crossing`` environment (``streamrl data make``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    """A service process (``python -m <module>``, or ``launcher`` starting it, e.g. torchrun) in its
    own process group, signalled by pid. ``port`` 0 lets the service bind any free port; without a
    ``worker_id`` it names itself; ``env`` replaces the environment."""

    module: str
    config: Path
    worker_id: str | None
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    launcher: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None

    def start(self) -> Service:
        cmd = [sys.executable, *(self.launcher or ["-m", self.module]), "--config", str(self.config)]
        cmd += ["--port", str(self.port)] + (["--worker-id", self.worker_id] if self.worker_id else [])
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float, poll_s: float = 0.25) -> None:
        """Until ``GET /ready`` answers 200; fails with the log's tail if the process exits first
        or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            assert self.alive(), f"{self.module} exited ({self.proc and self.proc.returncode}):\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.module} not ready within {timeout_s:.0f}s:\n{self.tail()}"
            time.sleep(poll_s)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):  # not listening yet, or 503 while it starts
            return False

    def signal(self, sig: int) -> None:
        """``sig`` to the whole process group (the service and what it started)."""
        os.killpg(self.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self, *, whole_group: bool = True) -> int | None:
        """SIGTERM (after a SIGCONT: a frozen process would never see it), to the process group or,
        for a service that stops its own children, to the process alone; SIGKILL to the group if it
        has not exited 30 s later. The exit code; None when it had to be killed."""
        if not self.alive():
            return self.proc.returncode if self.proc is not None else None
        assert self.proc is not None
        send = self.signal if whole_group else self.proc.send_signal
        send(signal.SIGCONT)
        send(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    def crashed(self) -> bool:
        """Exited by anything but a clean end (0, or SIGTERM: a gateway leaves a finished run by
        signalling itself and uvicorn re-raises the signal after its drain), or logged a CRITICAL."""
        code = self.proc.poll() if self.proc is not None else None
        return code not in (None, 0, -signal.SIGTERM) or "CRITICAL" in self.tail(10**7)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def metric(self, name: str) -> float:
        """One unlabelled sample of the service's Prometheus /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)


def start_job(config: Path, log: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``streamrl up CONFIG [overrides]`` in a session of its own (signals come from the test only)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "up", str(config), "--no-progress", *overrides],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_job_up(job: subprocess.Popen[bytes], out: Path, log: Path, path: str, timeout_s: float = 300) -> dict:
    """Until the job's run.json (in its output folder ``out``) names its trainer and the trainer
    answers ``GET path`` with 200; run.json. Fails with the log's tail if the job exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert job.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the job did not come up:\n" + log.read_text()[-3000:]
        try:
            run = json.loads((out / "run.json").read_text())
            with urllib.request.urlopen(f"{run['trainer_url']}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return dict(run)
        except (OSError, ValueError, KeyError):  # not written yet, or the trainer not up yet
            pass
        time.sleep(0.5)


def streamrl(*args: str, timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``streamrl ARGS`` run to its end; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "streamrl.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def make_data(path: Path, n: int, seed: int | None = None) -> Path:
    """``n`` rows of the demo's ``crossing`` environment in ``path`` (JSONL)."""
    cmd = ["data", "make", "crossing", str(path), "--n", str(n)] + (["--seed", str(seed)] if seed is not None else [])
    subprocess.run([sys.executable, "-m", "streamrl.cli", *cmd], check=True, cwd=ROOT)
    return path

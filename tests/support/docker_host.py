"""A Docker engine for the tests that need a real one (tests/compose).

`docker_engine()` yields a DOCKER_HOST that answers `docker info`:

* the engine the environment already names (DOCKER_HOST, else the default socket) when it answers;
* else, as root, Debian's dockerd (20.10, from `apt-get install docker.io` when it is missing),
  started by the test with its own socket and runtime folder under /run/streamrl-docker and its
  data under STREAMRL_DOCKER_CACHE (default /var/cache/streamrl-docker), a folder the machine may
  keep between runs, so the base and service images built there are reused. It runs with bridge
  networking and iptables (compose networks, NAT for the package registries the image build
  reaches) and is stopped by its pid at the end; its containerd is its child and stops with it.

When neither can be had it raises `NoEngine` with the reason; the caller skips, or fails in CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_DIR = Path("/run/streamrl-docker")  # short: unix socket paths are limited to about 100 bytes
CACHE_DIR = Path(os.environ.get("STREAMRL_DOCKER_CACHE", "/var/cache/streamrl-docker"))
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 60.0


class NoEngine(RuntimeError):
    """No Docker engine answers here and none can be started."""


def engine_answers(docker_host: str | None) -> bool:
    env = {**os.environ, **({"DOCKER_HOST": docker_host} if docker_host else {})}
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _install_docker() -> None:
    if shutil.which("apt-get") is None:
        raise NoEngine("dockerd is not installed and there is no apt-get to install docker.io")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "docker.io", "debootstrap"]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise NoEngine(f"{' '.join(cmd)} failed: {(out.stdout + out.stderr)[-1000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def docker_engine(log_path: Path) -> Iterator[str]:
    """Yields the DOCKER_HOST of a working engine (see the module docstring); stops the engine if
    it started it. ``log_path`` receives dockerd's log."""
    current = os.environ.get("DOCKER_HOST")
    if engine_answers(current):
        yield current or "unix:///var/run/docker.sock"
        return
    if os.geteuid() != 0:
        raise NoEngine("no Docker engine answers (docker info) and starting dockerd needs root")
    if shutil.which("dockerd") is None or shutil.which("debootstrap") is None:
        _install_docker()
    if shutil.which("docker") is None:
        raise NoEngine("no docker CLI on PATH")
    host = f"unix://{RUN_DIR}/docker.sock"
    if engine_answers(host):  # left running by an earlier run that was killed: not ours to stop
        yield host
        return
    (CACHE_DIR / "data").mkdir(parents=True, exist_ok=True)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [
        "dockerd",
        "--host",
        host,
        "--data-root",
        str(CACHE_DIR / "data"),
        "--exec-root",
        str(RUN_DIR / "exec"),
        "--pidfile",
        str(RUN_DIR / "dockerd.pid"),
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not engine_answers(host):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise NoEngine(f"dockerd did not come up (exit {proc.poll()}): {tail}")
            time.sleep(1.0)
        yield host
    finally:
        _stop(proc)

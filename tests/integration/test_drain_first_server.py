"""`shared.service.DrainFirstServer`: on SIGTERM the app's drain runs while the server still accepts
new connections (a gateway's rollouts reach its own proxy between turns; a draining generator
still serves its sessions), then the server stops; a second signal cuts the drain short. (Plain
uvicorn closes its listening socket as soon as the signal arrives.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from streamrl.redis_server import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

APP = """
import asyncio, os, sys
import uvicorn
from fastapi import FastAPI
from shared.service import DrainFirstServer

port, mode, marker, release = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
drain_timeout_s = float(sys.argv[5])
app = FastAPI()

@app.get("/ping")
async def ping():
    return {"ok": True}

async def drain():
    # Runs until the test creates the release file: the test, not the clock, ends it.
    open(marker, "w").write("draining")
    while not os.path.exists(release):
        await asyncio.sleep(0.02)
    open(marker, "w").write("drained")

config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
DrainFirstServer(config, drain, drain_timeout_s=drain_timeout_s).run()
"""

# Far longer than any wait of these tests: a drain that ended here ended by the test's hand (the
# release file) or by a second signal, never at its own timeout.
DRAIN_TIMEOUT_S = 600.0


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, str, Path, Path]:
    """The app as a process: (process, url, the drain's marker file, the file that ends its drain)."""
    script, marker, release, port = tmp_path / "app.py", tmp_path / f"{mode}.marker", tmp_path / "release", free_port()
    script.write_text(APP)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port), mode, str(marker), str(release), str(DRAIN_TIMEOUT_S)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/ping", timeout=1.0).status_code == 200:
                return proc, url, marker, release
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "test app did not start"
        time.sleep(0.1)


def _drain_started(proc: subprocess.Popen, marker: Path) -> None:
    deadline = time.monotonic() + 30
    while not marker.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the drain did not start"
        time.sleep(0.02)


def _ping(url: str) -> bool:
    try:
        # A fresh client each time: a new connection, as a rollout's next turn may open.
        with httpx.Client() as client:
            return client.get(f"{url}/ping", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def test_new_connections_are_served_while_the_drain_runs_then_the_server_stops(tmp_path):
    proc, url, marker, release = _start(tmp_path, "drain-first")
    proc.send_signal(signal.SIGTERM)
    _drain_started(proc, marker)
    assert _ping(url)  # during the drain
    time.sleep(1.0)  # a while into it: the drain lasts until the test releases it
    assert _ping(url) and marker.read_text() == "draining" and proc.poll() is None
    release.touch()  # the drain ends ...
    code = _wait(proc, 60)
    assert code is not None and marker.read_text() == "drained"  # ... and only then did the server stop
    assert not _ping(url)


def test_a_second_signal_cuts_the_drain_short(tmp_path):
    proc, _, marker, _ = _start(tmp_path, "drain-first")
    proc.send_signal(signal.SIGTERM)
    _drain_started(proc, marker)
    proc.send_signal(signal.SIGTERM)
    # The drain never ends by itself (nothing releases it; its timeout is DRAIN_TIMEOUT_S): the
    # process ending at all, with the drain unfinished, is the second signal's doing.
    assert _wait(proc, 60) is not None
    assert marker.read_text() == "draining"

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
import asyncio, sys, time
import uvicorn
from fastapi import FastAPI
from shared.service import DrainFirstServer

port, mode, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
app = FastAPI()

@app.get("/ping")
async def ping():
    return {"ok": True}

async def drain():
    open(marker, "w").write("draining")
    await asyncio.sleep(3.0)
    open(marker, "w").write("drained")

config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
DrainFirstServer(config, drain, drain_timeout_s=10.0).run()
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, str, Path]:
    script, marker, port = tmp_path / "app.py", tmp_path / f"{mode}.marker", free_port()
    script.write_text(APP)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port), mode, str(marker)],
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
                return proc, url, marker
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "test app did not start"
        time.sleep(0.1)


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
    proc, url, marker = _start(tmp_path, "drain-first")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while not marker.is_file():
        assert time.monotonic() - t0 < 5, "the drain did not start"
        time.sleep(0.02)
    assert _ping(url)  # during the drain
    time.sleep(1.0)
    assert _ping(url) and marker.read_text() == "draining"
    code = _wait(proc, 15)
    assert code is not None and marker.read_text() == "drained"
    assert time.monotonic() - t0 >= 3.0
    assert not _ping(url)


def test_a_second_signal_cuts_the_drain_short(tmp_path):
    proc, _, marker = _start(tmp_path, "drain-first")
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while not marker.is_file():
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert _wait(proc, 10) is not None
    assert time.monotonic() - t0 < 2.5 and marker.read_text() == "draining"

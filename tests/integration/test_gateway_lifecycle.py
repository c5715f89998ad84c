"""The gym gateway on the shared service lifecycle (`shared.service`), over a real Valkey.

A worker loop that dies fails the gateway loudly: /ready answers 503 naming the error, the registry
shows "failed" with it at once, and the process exits with code 1 (so a restart policy acts). A
loop that ends because the run was stopped ends the gateway cleanly: exit code 0, deregistered.
In-process through the app's lifespan, and as ``python -m services.gym_gateway`` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from services.gym_gateway.app import build_app
from shared.config import decode_tree
from shared.keys import RunKeys
from shared.registry import live_workers
from shared.run_config import RunConfig
from shared.service import EXIT_FAILED, EXIT_OK
from shared.streams import connect
from tests.support.services import Service

pytestmark = pytest.mark.integration


def _tree(redis_url: str, tmp_path: Path) -> dict:
    return {
        "run": {"run_id": f"gwl-{uuid.uuid4().hex[:8]}", "output_dir": str(tmp_path)},
        "redis": {"url": redis_url},
        "data": {"train_path": "unused.jsonl"},
        "policy": {"model_name": "unused-model"},
        "gym_gateway": {"drain_timeout_s": 2.0},
    }


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


@contextlib.asynccontextmanager
async def _served(app):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30.0) as client:
            yield client


async def _until(check, what: str, timeout_s: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (found := await check()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return found


async def _heartbeat(redis, run_id: str, state: str):
    records = await live_workers(redis, RunKeys(run_id), "gym_gateway")
    return records[0] if len(records) == 1 and records[0].state == state else None


async def test_a_worker_loop_that_dies_fails_the_gateway_loudly(redis, redis_url, tmp_path):
    cfg = decode_tree(_tree(redis_url, tmp_path), RunConfig)
    await redis.set(RunKeys(cfg.run.run_id).tasks, "not a stream")  # the loop's first read fails
    app = build_app(cfg, worker_id="gw-dies", port=0)
    async with _served(app) as client:
        hb = await _until(lambda: _heartbeat(redis, cfg.run.run_id, "failed"), "a failed heartbeat")
        lifecycle = app.state.lifecycle
        assert lifecycle.exit_code == EXIT_FAILED and "gateway-worker died" in lifecycle.error
        assert "WRONGTYPE" in hb.error and hb.error == lifecycle.error
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "failed"
        assert ready.json()["error"] == lifecycle.error
        assert (await client.get("/health")).status_code == 200  # still answering while it stops
    assert await live_workers(redis, RunKeys(cfg.run.run_id), "gym_gateway") == []  # deregistered


async def test_the_runs_end_stops_the_gateway_cleanly(redis, redis_url, tmp_path):
    cfg = decode_tree(_tree(redis_url, tmp_path), RunConfig)
    app = build_app(cfg, worker_id="gw-ends", port=0)
    async with _served(app) as client:
        await _until(lambda: _heartbeat(redis, cfg.run.run_id, "ready"), "a ready heartbeat")
        ready = await client.get("/ready")
        assert ready.status_code == 200 and ready.json() == {"ready": True, "state": "ready"}
        await redis.set(RunKeys(cfg.run.run_id).stop, "1")
        await _until(lambda: _exit_decided(app), "the gateway to decide its exit")
        assert app.state.lifecycle.exit_code == EXIT_OK and not app.state.lifecycle.failed
        assert (await client.get("/ready")).status_code == 503


async def _exit_decided(app) -> bool:
    return app.state.lifecycle.exit_code is not None


# -- as processes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _gateway_process(tree: dict, tmp_path: Path, worker_id: str):
    config = tmp_path / f"{worker_id}.yaml"
    config.write_text(yaml.safe_dump(tree))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    gateway = Service("services.gym_gateway", config, worker_id, tmp_path / f"{worker_id}.log", port=0, env=env)
    try:
        yield gateway.start().proc
    finally:
        if gateway.alive():
            gateway.kill9()  # by pid: the process this test started


async def _exit_code(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while proc.poll() is None:
        assert asyncio.get_running_loop().time() < deadline, "the gateway process did not exit"
        await asyncio.sleep(0.1)
    return proc.returncode


async def test_a_gateway_process_exits_0_when_the_run_stops(redis, redis_url, tmp_path):
    tree = _tree(redis_url, tmp_path)
    run_id = tree["run"]["run_id"]
    with _gateway_process(tree, tmp_path, "gw-proc-ok") as proc:
        hb = await _until(lambda: _heartbeat(redis, run_id, "ready"), "the gateway process to register", 60.0)
        assert hb.url.startswith("http://127.0.0.1:") and not hb.url.endswith(":0")  # the bound port
        assert httpx.get(f"{hb.url}/ready").status_code == 200
        await redis.set(RunKeys(run_id).stop, "1")
        code = await _exit_code(proc)
    assert code == EXIT_OK, (tmp_path / "gw-proc-ok.log").read_text()
    assert await live_workers(redis, RunKeys(run_id), "gym_gateway") == []


async def test_a_gateway_process_whose_loop_dies_exits_1(redis, redis_url, tmp_path):
    tree = _tree(redis_url, tmp_path)
    await redis.set(RunKeys(tree["run"]["run_id"]).tasks, "not a stream")
    with _gateway_process(tree, tmp_path, "gw-proc-dies") as proc:
        code = await _exit_code(proc)
    log = (tmp_path / "gw-proc-dies.log").read_text()
    assert code == EXIT_FAILED, log
    assert "gateway-worker died" in log and "WRONGTYPE" in log

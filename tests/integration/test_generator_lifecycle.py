"""The generator on the shared service lifecycle (`shared.service`): a background task that dies
(the bring-up, the weight watcher) fails the service loudly instead of leaving it up and unready:
/ready answers 503 with the error, the registry shows "failed" with it at once, generation is
refused, and the lifecycle asks the server to stop with exit code 1. Served in-process with the
transformers engine on the tiny model and a real Valkey."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest

from services.generator.app import build_app
from services.generator.hf_engine import HfEngine
from shared.keys import RunKeys
from shared.registry import live_workers
from shared.service import EXIT_FAILED
from shared.streams import connect

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "Name a fruit."}


class _EngineThatCannotStart(HfEngine):
    async def start(self) -> None:
        raise RuntimeError("no memory left for the KV cache")


@contextlib.asynccontextmanager
async def _served(app):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://generator", timeout=60.0) as client:
            yield client


async def _until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _failed_heartbeat(redis, run_id: str):
    records = await live_workers(redis, RunKeys(run_id), "generator")
    return records[0] if len(records) == 1 and records[0].state == "failed" else None


async def _assert_failed_loudly(app, client, redis, run_id: str, error: str) -> None:
    """What every dead task does to the generator: each observer sees "failed" naming ``error``."""
    lifecycle = app.state.lifecycle
    await _until(lambda: _failed_heartbeat(redis, run_id), "the registry to show the generator failed", 10.0)
    assert lifecycle.failed and error in lifecycle.error and lifecycle.exit_code == EXIT_FAILED
    ready = await client.get("/ready")
    assert ready.status_code == 503 and ready.json()["state"] == "failed" and error in ready.json()["error"]
    hb = await _failed_heartbeat(redis, run_id)
    assert error in hb.error
    r = await client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 2})
    assert r.status_code == 503 and error in r.json()["error"]["message"]
    assert (await client.get("/health")).status_code == 200  # still answering while it drains and exits


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


async def test_a_bring_up_that_dies_fails_the_generator_loudly(write_config, tiny_model_dir, redis_url, redis):
    _, cfg = write_config(tiny_model_dir, redis_url=redis_url)
    app = build_app(cfg, worker_id=f"gen-{uuid.uuid4().hex[:6]}", port=0, engine=_EngineThatCannotStart(cfg))
    async with _served(app) as client:
        await _assert_failed_loudly(
            app, client, redis, cfg.run.run_id, "bring-up died: RuntimeError: no memory left for the KV cache"
        )
    assert await live_workers(redis, RunKeys(cfg.run.run_id), "generator") == []  # deregistered on the way out


async def test_a_weight_watcher_that_dies_fails_the_generator_loudly(write_config, tiny_model_dir, redis_url, redis):
    _, cfg = write_config(tiny_model_dir, redis_url=redis_url)
    app = build_app(cfg, worker_id=f"gen-{uuid.uuid4().hex[:6]}", port=0)
    watching, die = asyncio.Event(), asyncio.Event()

    async def watch(cursor: str) -> None:  # the real watcher's place, dying on cue
        watching.set()
        await die.wait()
        raise ValueError("weights stream entry id 'x' is not a stream id")

    app.state.weights.watch = watch
    async with _served(app) as client:
        await _until(lambda: _ready(client), "the generator to become ready")
        await asyncio.wait_for(watching.wait(), 10)
        assert app.state.lifecycle.exit_code is None
        die.set()
        await _assert_failed_loudly(app, client, redis, cfg.run.run_id, "weight-watcher died: ValueError: weights")


async def _ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/ready")).status_code == 200


class _EngineThatDies(HfEngine):
    """Serves, until ``die()``: then it reports itself errored, as vLLM's client does once its
    engine core process is gone."""

    dead = False

    @property
    def errored(self) -> bool:
        return self.dead


async def test_an_engine_that_dies_while_serving_fails_the_generator_loudly(
    write_config, tiny_model_dir, redis_url, redis, monkeypatch
):
    import services.generator.app as generator_app

    monkeypatch.setattr(generator_app, "ENGINE_CHECK_S", 0.05)
    _, cfg = write_config(tiny_model_dir, redis_url=redis_url)
    engine = _EngineThatDies(cfg)
    app = build_app(cfg, worker_id=f"gen-{uuid.uuid4().hex[:6]}", port=0, engine=engine)
    async with _served(app) as client:
        await _until(lambda: _ready(client), "the generator to become ready")
        assert app.state.lifecycle.exit_code is None
        engine.dead = True
        await _assert_failed_loudly(
            app, client, redis, cfg.run.run_id, "engine-watch died: RuntimeError: the engine died"
        )

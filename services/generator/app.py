"""The generator's FastAPI app: `build_app` wires the long-lived objects, the lifespan runs them.

Built in named steps (engine, tokenizer + renderer, runtime, metrics, service, weight sync, app);
everything long-lived hangs off ``app.state``. The lifespan starts, in this order::

    loop-lag probe, Redis client + heartbeat (state "starting")
    bring-up task: engine.start -> load the newest announced weights -> freeze the start-up heap
                   (no garbage collection pauses over it) -> state "ready"
                   -> weight watcher task (follows the weights stream)

so /health answers while the engine loads. A bring-up or watcher task that dies marks the
generator failed (/ready 503, heartbeat "failed" with the error). Shutdown: state "draining"
(set at SIGTERM by `begin_drain`), wait up to generator.drain_timeout_s for in-flight requests,
stop the tasks, deregister, close the engine and Redis, each with a time limit.

Without ``redis.url`` the generator serves alone: no heartbeat, no weight stream (admin loads
still work). Called by `services.generator.__main__` and by tests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI

from services.generator.chat import ChatRenderer
from services.generator.engine import Engine, build_engine
from services.generator.metrics import GeneratorMetrics
from services.generator.routes_admin import router as admin_router
from services.generator.routes_openai import router as openai_router
from services.generator.runtime import Runtime
from services.generator.serving import GenerationService
from services.generator.weights import WeightSync
from shared.auth import AuthPolicy
from shared.http import install_error_handlers, require_agent_token
from shared.keys import RunKeys
from shared.openapi import document_bodies
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 30.0
_TASK_STOP_TIMEOUT_S = 5.0


def build_renderer(cfg: RunConfig) -> ChatRenderer:
    """Tokenizer and chat renderer for the policy (the same files the engine loads)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.tokenizer_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {cfg.policy.tokenizer_path!r} has no chat template")
    vocab_size = int(getattr(AutoConfig.from_pretrained(cfg.policy.model_name), "vocab_size", 0) or 0)
    return ChatRenderer(tokenizer, cfg.generator.turn_terminator, vocab_size)


def advertised_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://{host}:{port}"


def build_app(cfg: RunConfig, worker_id: str, port: int, *, engine: Engine | None = None) -> FastAPI:
    """The generator app for ``cfg``; the engine starts in the lifespan, not here."""
    gen_cfg = cfg.generator
    engine = engine if engine is not None else build_engine(cfg)  # 1. engine client
    renderer = build_renderer(cfg)  # 2. tokenizer + chat template
    runtime = Runtime(  # 3. state and admission
        engine,
        worker_id,
        max_concurrent_requests=gen_cfg.max_concurrent_requests,
        drain_timeout_s=gen_cfg.drain_timeout_s,
    )
    metrics = GeneratorMetrics(runtime)  # 4. metrics
    service = GenerationService(  # 5. request handling
        cfg.policy.generation, runtime, renderer, metrics, model_name=cfg.policy.model_name
    )
    weights = WeightSync(runtime, metrics, None, load_timeout_s=gen_cfg.weight_load_timeout_s)  # 6. refits

    app = FastAPI(title="streamrl generator", lifespan=_lifespan)  # 7. the app
    s = app.state
    s.cfg, s.runtime, s.metrics, s.service, s.weights, s.renderer = cfg, runtime, metrics, service, weights, renderer
    s.worker_id, s.url, s.started_at = worker_id, advertised_url(gen_cfg.host, port), time.time()
    s.redis = s.heartbeat = None
    s.tasks = {}
    s.auth = AuthPolicy.from_env(cfg.auth.protect_agent_routes)  # admin routes check it (routes_admin)
    metrics.count_dead_letters(lambda: s.weights.streams)  # the weights stream, once the lifespan connects
    install_error_handlers(app)
    app.include_router(openai_router, dependencies=[Depends(require_agent_token)])
    app.include_router(admin_router)
    document_bodies(app)
    return app


def begin_drain(app: FastAPI) -> None:
    """Stop admitting requests and tell the registry (called at SIGTERM, before uvicorn drains)."""
    app.state.runtime.draining = True
    if app.state.heartbeat is not None:
        app.state.heartbeat.beat_now()


def _heartbeat_snapshot(app: FastAPI) -> Heartbeat:
    s = app.state
    rt: Runtime = s.runtime
    stats = rt.engine.stats()
    return Heartbeat(
        worker_id=s.worker_id,
        kind="generator",
        url=s.url,
        pid=os.getpid(),
        host=socket.gethostname(),
        state=rt.state,  # type: ignore[arg-type]
        weight_version=rt.weight_version,
        in_flight=rt.in_flight,
        started_at=s.started_at,
        stats={
            "tokens_per_s": rt.tokens_per_s(),
            "running": float(stats.running),
            "waiting": float(rt.waiting + stats.waiting),
            "generated_tokens_total": float(stats.generated_tokens_total),
            "requests_total": float(rt.requests_total),
            "prefix_cache_resets": float(rt.prefix_cache_resets),
            "last_refit_s": rt.last_refit_s,
        },
        error=rt.error,
    )


async def _bring_up(app: FastAPI) -> None:
    """Start the engine, load the newest announced weights, then follow the weights stream."""
    s = app.state
    t0 = time.monotonic()
    await s.runtime.engine.start()
    log.info("engine %s started in %.1fs", s.runtime.engine.info.name, time.monotonic() - t0)
    cursor = await s.weights.load_initial() if s.weights.streams is not None else None
    freeze_startup_heap()
    s.runtime.started = True
    log.info("generator %s ready at %s (weight version %d)", s.worker_id, s.url, s.runtime.weight_version)
    if s.heartbeat is not None:
        s.heartbeat.beat_now()
    if cursor is not None:
        _start_task(app, "weight-watcher", s.weights.watch(cursor))


def freeze_startup_heap() -> None:
    """Exempt everything alive after start-up (engine client, tokenizer, app) from garbage
    collection, as vLLM's own API server does. A full collection walks that whole heap: 0.3-0.7 s
    on a small CPU machine, during which the event loop admits and answers nothing and the
    engine's batch runs empty (seen by ``streamrl bench --only generator``)."""
    gc.collect()
    gc.freeze()


def _start_task(app: FastAPI, name: str, coro: Any) -> None:
    task = asyncio.create_task(coro, name=name)
    app.state.tasks[name] = task

    def _done(t: asyncio.Task) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            log.error("%s died", name, exc_info=exc)
            app.state.runtime.fail(f"{name} died: {type(exc).__name__}: {exc}")
            if app.state.heartbeat is not None:
                app.state.heartbeat.beat_now()

    task.add_done_callback(_done)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    s = app.state
    s.metrics.start_loop_lag_probe()
    if s.cfg.redis.url:
        s.redis = connect(s.cfg.redis.url)
        keys = RunKeys(s.cfg.run.run_id)
        s.weights.streams = StreamClient(s.redis, keys, s.worker_id)
        s.heartbeat = HeartbeatTask(s.redis, keys, lambda: _heartbeat_snapshot(app))
        s.heartbeat.start()
    else:
        log.warning("no redis.url: not registering and not following the weights stream")
    _start_task(app, "bring-up", _bring_up(app))
    try:
        yield
    finally:
        await _shutdown(app)


async def _wait_idle(runtime: Runtime, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while runtime.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if runtime.in_flight:
        log.warning("shutting down with %d request(s) still in flight", runtime.in_flight)


async def _shutdown(app: FastAPI) -> None:
    s = app.state
    begin_drain(app)
    await _wait_idle(s.runtime, s.cfg.generator.drain_timeout_s)
    s.weights.stop()
    await _stop_tasks(list(s.tasks.values()))
    if s.heartbeat is not None:
        await _bounded(s.heartbeat.aclose(s.worker_id), "deregister")
    await _bounded(s.runtime.engine.aclose(), "engine close")
    if s.redis is not None:
        await _bounded(s.redis.aclose(), "redis close")
    await s.metrics.aclose()
    log.info("generator %s stopped after %d request(s)", s.worker_id, s.runtime.requests_total)


async def _stop_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait a bounded time; their loops also check a stop flag, because a
    cancellation can be lost inside the Redis client."""
    for task in tasks:
        task.cancel()
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=_TASK_STOP_TIMEOUT_S)
        for task in still:
            log.warning("task %s did not stop within %.0fs", task.get_name(), _TASK_STOP_TIMEOUT_S)


async def _bounded(coro: Any, what: str) -> None:
    try:
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await coro
    except Exception as exc:  # shutdown goes on: log and close the rest
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)

"""The generator's FastAPI app, on the lifecycle every service shares (`shared.service`).

`build_app` constructs the long-lived objects in named steps (engine, tokenizer + renderer,
runtime, metrics, service, weight sync, app) without I/O and keeps them on ``app.state``, with a
`ServiceLifecycle`. The lifespan starts, in this order::

    tracing (`shared.tracing`, when on), loop-lag probe, Redis client + heartbeat (state "starting")
    bring-up task: engine.start -> load the newest announced weights -> freeze the start-up heap
                   (no garbage collection pauses over it) -> state "ready"
                   -> weight watcher task (follows the weights stream)
                   -> engine watch task (raises once the engine died: vLLM's engine core is gone)

so /health answers while the engine loads. Every task is supervised: one that dies (an engine
that cannot start or died, an unreadable weights stream) fails the service loudly: state "failed" with
the error, the heartbeat says so at once, /ready answers 503, and the server drains and exits
with code 1 so a restart policy acts. A failed weight *load* is not a dead task: it marks the
generator failed (503 for generation) until a later load succeeds, and the process stays up.
Shutdown: state "draining" (set at SIGTERM by `begin_drain`), wait up to
generator.drain_timeout_s for in-flight requests, stop the tasks, deregister, close the engine
and Redis, each with a time limit, and write the spans still queued.

Without ``redis.url`` the generator serves alone: no heartbeat, no weight stream (admin loads
still work). Called by `services.generator.__main__` and by tests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from services.generator.chat import ChatRenderer
from services.generator.engine import Engine, build_engine
from services.generator.metrics import GeneratorMetrics
from services.generator.routes_admin import router as admin_router
from services.generator.routes_openai import router as openai_router
from services.generator.runtime import Runtime
from services.generator.serving import GenerationService
from services.generator.weights import WeightSync
from shared import tracing
from shared.admin_api import Readiness
from shared.auth import AuthPolicy
from shared.http import install_error_handlers, require_agent_token
from shared.keys import RunKeys
from shared.openapi import document_bodies
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from shared.run_config import RunConfig
from shared.service import ServiceLifecycle, add_probe_routes, advertised_url
from shared.streams import StreamClient, connect
from shared.tasks import bounded

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 30.0
ENGINE_CHECK_S = 1.0  # how often the engine-watch task asks whether the engine is still alive


def build_renderer(cfg: RunConfig) -> ChatRenderer:
    """Tokenizer and chat renderer for the policy (the same files the engine loads)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.tokenizer_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {cfg.policy.tokenizer_path!r} has no chat template")
    vocab_size = int(getattr(AutoConfig.from_pretrained(cfg.policy.model_name), "vocab_size", 0) or 0)
    return ChatRenderer(tokenizer, cfg.generator.turn_terminator, vocab_size)


def build_app(cfg: RunConfig, *, worker_id: str, port: int, engine: Engine | None = None) -> FastAPI:
    """The generator app for ``cfg``; nothing starts here (the engine starts in the lifespan)."""
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
        cfg.policy.generation,
        runtime,
        renderer,
        metrics,
        model_name=cfg.policy.model_name,
        replay_routes=cfg.policy.moe_routing_replay,
    )
    weights = WeightSync(runtime, metrics, None, load_timeout_s=gen_cfg.weight_load_timeout_s)  # 6. refits

    app = FastAPI(title="streamrl generator", lifespan=_lifespan)  # 7. the app
    s = app.state
    s.cfg, s.runtime, s.metrics, s.service, s.weights, s.renderer = cfg, runtime, metrics, service, weights, renderer
    s.worker_id, s.url, s.started_at = worker_id, advertised_url(gen_cfg.host, port, cfg.redis.url), time.time()
    s.redis = s.heartbeat = None
    s.lifecycle = ServiceLifecycle("generator")
    s.lifecycle.on_failure(lambda error: _mark_failed(app, error))
    s.auth = AuthPolicy.from_env(cfg.auth.protect_agent_routes)  # admin routes check it (routes_admin)
    metrics.count_dead_letters(lambda: s.weights.streams)  # the weights stream, once the lifespan connects
    install_error_handlers(app)
    app.include_router(openai_router, dependencies=[Depends(require_agent_token)])
    app.include_router(admin_router)
    add_probe_routes(app, lambda: readiness(runtime), _render_metrics(metrics))
    document_bodies(app)
    return app


def readiness(rt: Runtime) -> Readiness:
    """``GET /ready``: ready while the engine is up and the generator is not failed or draining
    (paused and loading still count: they end by themselves)."""
    return Readiness(ready=rt.ready, state=rt.state, weight_version=rt.weight_version, error=rt.error)


def _render_metrics(metrics: GeneratorMetrics) -> Callable[[], Awaitable[bytes]]:
    async def render() -> bytes:
        return metrics.render()

    return render


def _mark_failed(app: FastAPI, error: str) -> None:
    """The lifecycle's failure hook: state "failed" with the error, in the registry at once."""
    app.state.runtime.fail(error)
    if app.state.heartbeat is not None:
        app.state.heartbeat.beat_now()


async def drain(app: FastAPI) -> None:
    """The generator's drain at SIGTERM, while the server still listens: "draining" in the registry
    at once (gateways stop routing new sessions here), then the sessions it has until none called
    for generator.drain_session_idle_s, at most generator.drain_timeout_s. A failed generator has
    no sessions to keep."""
    begin_drain(app)
    if not app.state.lifecycle.failed:
        gen_cfg = app.state.cfg.generator
        await app.state.runtime.drain_sessions(gen_cfg.drain_session_idle_s, gen_cfg.drain_timeout_s)


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
        state=rt.state,
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
    info = s.runtime.engine.info
    log.info("engine %s started in %.1fs", info.name, time.monotonic() - t0)
    if s.cfg.policy.moe_routing_replay and info.route_shape is None:
        raise RuntimeError(
            f"policy.moe_routing_replay is on, but the {info.name} engine cannot return the MoE routes of {info.model}"
        )
    s.runtime.awaiting_weights = s.runtime.engine.info.random_weights
    cursor = await s.weights.load_initial() if s.weights.streams is not None else None
    freeze_startup_heap()
    s.runtime.started = True
    log.info("generator %s ready at %s (weight version %d)", s.worker_id, s.url, s.runtime.weight_version)
    if s.heartbeat is not None:
        s.heartbeat.beat_now()
    s.lifecycle.supervise("engine-watch", watch_engine(s.runtime.engine, ENGINE_CHECK_S))
    if cursor is not None:
        s.lifecycle.supervise("weight-watcher", s.weights.watch(cursor))


async def watch_engine(engine: Engine, interval_s: float) -> None:
    """Raise once the engine died (vLLM's engine core process is gone): it cannot serve again, so
    the service fails and exits for its restart policy, instead of answering 503 forever."""
    while not engine.errored:
        await asyncio.sleep(interval_s)
    raise RuntimeError("the engine died")


def freeze_startup_heap() -> None:
    """Exempt everything alive after start-up (engine client, tokenizer, app) from garbage
    collection, as vLLM's own API server does. A full collection walks that whole heap: 0.3-0.7 s
    on a small CPU machine, during which the event loop admits and answers nothing and the
    engine's batch runs empty (seen by ``streamrl bench --only generator``)."""
    gc.collect()
    gc.freeze()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    s = app.state
    s.traced = tracing.setup(s.cfg.tracing, service="generator", worker_id=s.worker_id, output_dir=s.cfg.run.output_dir)
    s.metrics.start_loop_lag_probe()
    if s.cfg.redis.url:
        s.redis = connect(s.cfg.redis.url)
        keys = RunKeys(s.cfg.run.run_id)
        s.weights.streams = StreamClient(s.redis, keys, s.worker_id)
        s.heartbeat = HeartbeatTask(s.redis, keys, lambda: _heartbeat_snapshot(app))
        s.heartbeat.start()
    else:
        log.warning("no redis.url: not registering and not following the weights stream")
    s.lifecycle.supervise("bring-up", _bring_up(app))
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
    await s.lifecycle.stop_tasks()
    if s.heartbeat is not None:
        await bounded(s.heartbeat.aclose(s.worker_id), "deregister", _CLOSE_TIMEOUT_S)
    await bounded(s.runtime.engine.aclose(), "engine close", _CLOSE_TIMEOUT_S)
    if s.redis is not None:
        await bounded(s.redis.aclose(), "redis close", _CLOSE_TIMEOUT_S)
    await s.metrics.aclose()
    if s.traced:
        tracing.shutdown()  # the spans still queued are written
    log.info("generator %s stopped after %d request(s)", s.worker_id, s.runtime.requests_total)

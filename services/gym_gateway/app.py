"""The gym gateway's FastAPI app, on the lifecycle every service shares (`shared.service`).

`build_app` makes what needs no I/O and keeps it on ``app.state``: the config, the advertised URL,
the auth policy, the metrics (`services.gym_gateway.metrics`), the session forwarder and a
`ServiceLifecycle`; it mounts the session routes (`services.gym_gateway.session_routes`), the
session API for external agents (`services.gym_gateway.external_routes`, control routes) and the
probes. The lifespan then runs, in this order::

    open:      tracing (`shared.tracing`, when on), Redis client, HTTP client, generator pool +
               session proxy (``app.state.proxy``), task worker (``app.state.worker``), heartbeat,
               loop-lag probe
    supervise: the worker loop, "gateway-worker" (ends_service: its return ends the service),
               the keep-alive of the external tasks it holds, "external-keepalive", and the
               generators' health (publish this worker's calls, read the fleet's), "generator-health"
    yield      (the server drains the worker at SIGTERM or at the run's end, `__main__`)
    close:     the worker's drain (gym_gateway.drain_timeout_s), the tasks, the heartbeat
               (deregisters), the probe, the HTTP client, Redis; each bounded in time; spans flushed

A worker loop that raises fails the service: the heartbeat says "failed" with the error at once,
``/ready`` answers 503, and the server drains and exits with code 1. A loop that returns (the run
was stopped) ends the service with exit code 0 after the drain. ``/ready`` is 200 while the loop
runs and the worker is not draining. Called by `services.gym_gateway.__main__` and by tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import redis.asyncio as aioredis
from fastapi import Depends, FastAPI

from services.gym_gateway.external_routes import router as external_router
from services.gym_gateway.forwarding import SessionForwarder
from services.gym_gateway.metrics import GatewayMetrics
from services.gym_gateway.proxy import GeneratorPool, SessionProxy
from services.gym_gateway.session_calls import SessionCalls
from services.gym_gateway.session_routes import router as session_router
from services.gym_gateway.worker import GatewayWorker
from shared import keys as K
from shared import tracing
from shared.admin_api import Readiness
from shared.auth import AuthPolicy, client_headers
from shared.http import install_error_handlers, require_agent_token
from shared.openapi import document_bodies
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from shared.run_config import RunConfig
from shared.service import (
    ServiceLifecycle,
    add_probe_routes,
    advertised_url,
    freeze_startup_objects,
)
from shared.streams import StreamClient, connect
from shared.tasks import bounded

log = logging.getLogger(__name__)

WORKER_TASK = "gateway-worker"
KEEPALIVE_TASK = "external-keepalive"
HEALTH_TASK = "generator-health"
_CLOSE_TIMEOUT_S = 10.0


def build_app(cfg: RunConfig, *, worker_id: str, port: int) -> FastAPI:
    """The gateway app for ``cfg``, serving on ``port``; nothing is opened here."""
    app = FastAPI(title="streamrl gym gateway", lifespan=_lifespan)
    s = app.state
    s.cfg, s.worker_id, s.started_at = cfg, worker_id, time.time()
    s.url = advertised_url(cfg.gym_gateway.host, port, cfg.redis.url)
    s.lifecycle = ServiceLifecycle("gym_gateway")
    s.auth = AuthPolicy.from_env(cfg.auth.protect_agent_routes)
    s.forwarder = SessionForwarder(worker_id)
    s.metrics = GatewayMetrics(lambda: app.state.worker)  # scraped only while the lifespan runs
    install_error_handlers(app)
    mount_session_routes(app)
    app.include_router(external_router)  # control routes: the token, whatever protect_agent_routes says
    add_probe_routes(app, lambda: readiness(app), s.metrics.render_text)
    document_bodies(app)
    return app


async def drain(app: FastAPI) -> None:
    """The gateway's drain at SIGTERM (or the run's end), while the session routes still listen:
    the worker stops reading tasks, lets running rollouts finish within
    gym_gateway.drain_timeout_s and releases the rest to the group."""
    await app.state.worker.drain(app.state.cfg.gym_gateway.drain_timeout_s)


def mount_session_routes(app: FastAPI) -> None:
    """The session routes behind the agent token, and in front of them the held sessions' model
    calls without the framework's per-call work (`services.gym_gateway.session_calls`)."""
    app.include_router(session_router, dependencies=[Depends(require_agent_token)])
    app.add_middleware(SessionCalls)


def readiness(app: FastAPI) -> Readiness:
    loop = app.state.lifecycle.tasks.get(WORKER_TASK)
    if loop is None:
        return Readiness(ready=False, state="starting")
    if app.state.worker.stopping:
        return Readiness(ready=False, state="draining")
    if loop.done():
        return Readiness(ready=False, state="stopped")
    return Readiness(ready=True, state="ready")


@dataclass
class _Clients:
    redis: aioredis.Redis
    http: aiohttp.ClientSession

    async def aclose(self) -> None:
        await bounded(self.http.close(), "closing the HTTP client", _CLOSE_TIMEOUT_S)
        await bounded(self.redis.aclose(), "closing Redis", _CLOSE_TIMEOUT_S)


def connector(max_concurrent_rollouts: int) -> aiohttp.TCPConnector:
    """The gateway's connection pool. aiohttp, not httpx: httpx's pool scans every connection per
    request, which took most of the gateway's CPU at 64 concurrent rollouts. Room for every
    rollout's calls at once (aiohttp's default of 100 would queue the rest). Idle connections
    expire well before the servers' keep-alive (120 s) closes them."""
    return aiohttp.TCPConnector(limit=4 * max_concurrent_rollouts, keepalive_timeout=30.0)


def _open_clients(cfg: RunConfig, auth: AuthPolicy) -> _Clients:
    # With protected agent routes the token goes with every call (generators, other gateway
    # workers, agent servers that call back); otherwise it is never sent.
    http = aiohttp.ClientSession(
        connector=connector(cfg.gym_gateway.max_concurrent_rollouts),
        headers=client_headers(auth.token) if auth.protect_agent_routes else None,
    )
    return _Clients(connect(cfg.redis.url or "redis://127.0.0.1:6379/0"), http)


def _build_worker(app: FastAPI, clients: _Clients) -> GatewayWorker:
    s, gw = app.state, app.state.cfg.gym_gateway
    keys = K.RunKeys(s.cfg.run.run_id)
    proxy = SessionProxy(
        GeneratorPool(clients.redis, keys, gateway_id=s.worker_id),
        clients.http,
        request_timeout_s=gw.request_timeout_s,
        max_failovers=gw.max_failovers,
        generator_wait_s=gw.generator_wait_s,
    )
    return GatewayWorker(
        StreamClient(clients.redis, keys, s.worker_id),
        proxy,
        clients.http,
        env_cfg=s.cfg.env,
        session_base_url=s.url,
        max_concurrent=gw.max_concurrent_rollouts,
        reclaim_idle_s=gw.reclaim_idle_s,
        gateway_id=s.worker_id,
    )


def _heartbeat(app: FastAPI) -> Heartbeat:
    s = app.state
    worker: GatewayWorker = s.worker
    lifecycle: ServiceLifecycle = s.lifecycle
    loop = lifecycle.tasks.get(WORKER_TASK)
    draining = worker.stopping or (loop is not None and loop.done())
    return Heartbeat(
        worker_id=s.worker_id,
        kind="gym_gateway",
        url=s.url,
        state="failed" if lifecycle.failed else "draining" if draining else "ready",
        in_flight=len(worker.active),
        started_at=s.started_at,
        stats={"completed": float(worker.completed), "sessions": float(len(worker.proxy.sessions))},
        error=lifecycle.error,
    )


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    s = app.state
    lifecycle: ServiceLifecycle = s.lifecycle
    traced = tracing.setup(s.cfg.tracing, service="gym_gateway", worker_id=s.worker_id, output_dir=s.cfg.run.output_dir)
    clients = _open_clients(s.cfg, s.auth)  # 1. clients
    worker = _build_worker(app, clients)  # 2. proxy and worker
    s.proxy, s.worker = worker.proxy, worker
    heartbeat = HeartbeatTask(clients.redis, worker.streams.keys, lambda: _heartbeat(app))  # 3. tasks
    lifecycle.on_failure(lambda _error: heartbeat.beat_now())  # "failed" in the registry at once
    heartbeat.start()
    s.metrics.start_loop_lag_probe()
    lifecycle.supervise(WORKER_TASK, worker.run(), ends_service=True)
    lifecycle.supervise(KEEPALIVE_TASK, worker.keep_external_tasks())
    lifecycle.supervise(HEALTH_TASK, worker.proxy.pool.keep_health())
    frozen = freeze_startup_objects()
    log.info(
        "gym gateway %s serving sessions at %s (%d start-up objects out of the collector)", s.worker_id, s.url, frozen
    )
    try:
        yield
    finally:
        drain_s = s.cfg.gym_gateway.drain_timeout_s
        await bounded(worker.drain(drain_s), "draining the worker", drain_s + _CLOSE_TIMEOUT_S)
        await lifecycle.stop_tasks()
        await bounded(worker.close_envs(), "closing the environments", _CLOSE_TIMEOUT_S)
        await bounded(heartbeat.aclose(s.worker_id), "deregistering", _CLOSE_TIMEOUT_S)
        await bounded(s.metrics.aclose(), "stopping the loop-lag probe", _CLOSE_TIMEOUT_S)
        await clients.aclose()
        if traced:
            tracing.shutdown()  # the spans still queued are written
        log.info("gym gateway %s stopped (%d trajectories published)", s.worker_id, worker.completed)

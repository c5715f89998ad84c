"""The gateway's HTTP app: the session proxy routes plus health, readiness and metrics.

    POST /sessions/{session_id}/v1/chat/completions   OpenAI chat, recorded per rollout
    POST /sessions/{session_id}/v1/completions        OpenAI completions (text or token-id prompts)
    GET  /sessions/{session_id}/v1/models             the model list of the session's generator
    POST /sessions/{session_id}/v1/responses, /ng-rollout/{session_id}/...   NeMo-Gym's model
                                                      server per rollout (nemo_gym_routes)
    GET  /health, /ready, /metrics

`build_app` creates the long-lived clients (Redis, HTTP client, proxy, worker) in named steps and keeps
them on ``app.state``; the lifespan starts the worker loop and the heartbeat, and on shutdown
drains running rollouts within ``drain_timeout_s`` before closing clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

import aiohttp
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Gauge

from services.gym_gateway.metrics import RolloutOutcomes
from services.gym_gateway.nemo_gym_routes import router as nemo_gym_router
from services.gym_gateway.proxy import GeneratorPool, SessionProxy
from services.gym_gateway.worker import GatewayWorker
from shared import keys as K
from shared.auth import AuthPolicy, client_headers
from shared.http import install_error_handlers, read_body, require_agent_token
from shared.metrics import CONTENT_TYPE, ServiceMetrics
from shared.openai_api import ChatCompletionRequest, CompletionRequest
from shared.openapi import document_bodies, json_body
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect

log = logging.getLogger(__name__)


def build_app(cfg: RunConfig, *, worker_id: str, port: int, drain_timeout_s: float = 30.0) -> FastAPI:
    gw = cfg.gym_gateway
    url = f"http://{gw.host}:{port}"
    metrics = ServiceMetrics("gym_gateway")
    started_at = time.time()
    auth = AuthPolicy.from_env(cfg.auth.protect_agent_routes)
    # With protected agent routes the token goes with every call this worker makes (generators, its
    # own session proxy, agent servers that call back into it); otherwise it is never sent.
    headers = client_headers(auth.token) if auth.protect_agent_routes else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # 1. clients
        redis = connect(cfg.redis.url or "redis://127.0.0.1:6379/0")
        keys = K.RunKeys(cfg.run.run_id)
        # aiohttp, not httpx: httpx's pool scans every connection per request, which took most of
        # the gateway's CPU at 64 concurrent rollouts. Idle connections expire well before the
        # servers' keep-alive (120 s) closes them.
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=4 * gw.max_concurrent_rollouts, keepalive_timeout=30.0),
            headers=headers,
        )
        streams = StreamClient(redis, keys, worker_id)
        # 2. proxy and worker
        proxy = SessionProxy(
            GeneratorPool(redis, keys), http, request_timeout_s=gw.request_timeout_s, max_failovers=gw.max_failovers
        )
        worker = GatewayWorker(
            streams,
            proxy,
            http,
            session_base_url=url,
            max_concurrent=gw.max_concurrent_rollouts,
            reclaim_idle_s=gw.reclaim_idle_s,
            max_turns=cfg.env.max_turns,
            gateway_id=worker_id,
            carry_mask_flag=cfg.env.should_mask_flagged_samples,
            env_cfg=cfg.env,
        )
        app.state.proxy, app.state.worker = proxy, worker

        def snapshot() -> Heartbeat:
            return Heartbeat(
                worker_id=worker_id,
                kind="gym_gateway",
                url=url,
                pid=os.getpid(),
                host=socket.gethostname(),
                state="draining" if worker.stopping else "ready",
                in_flight=len(worker.active),
                started_at=started_at,
                stats={"completed": float(worker.completed), "sessions": float(len(proxy.sessions))},
            )

        # 3. background tasks
        heartbeat = HeartbeatTask(redis, keys, snapshot)
        heartbeat.start()
        metrics.start_loop_lag_probe()
        loop_task = asyncio.create_task(worker.run(), name="gateway-worker")
        loop_task.add_done_callback(_die_loudly)
        app.state.loop_task = loop_task
        try:
            yield
        finally:
            await worker.drain(drain_timeout_s)  # also ends the loop within one blocking read
            loop_task.cancel()
            await asyncio.wait({loop_task}, timeout=5.0)
            await heartbeat.aclose(worker_id)
            await metrics.aclose()
            await http.close()
            await redis.aclose()

    app = FastAPI(title="streamrl gym gateway", lifespan=lifespan)
    install_error_handlers(app)
    app.state.auth = auth
    agent_auth = [Depends(require_agent_token)]
    app.include_router(nemo_gym_router, dependencies=agent_auth)  # NeMo-Gym's model-server paths per rollout
    metrics.registry.register(RolloutOutcomes(lambda: getattr(app.state, "worker", None)))
    metrics.count_dead_letters(lambda: getattr(getattr(app.state, "worker", None), "streams", None))
    g_active = Gauge("streamrl_gateway_active_rollouts", "Rollouts running", registry=metrics.registry)
    g_calls = Gauge("streamrl_gateway_model_calls_total", "Model calls through the proxy", registry=metrics.registry)
    g_breaks = Gauge(
        "streamrl_gateway_prefix_breaks_total",
        "Calls whose prompt broke the session's token prefix",
        ["env"],
        registry=metrics.registry,
    )
    g_released = Gauge(
        "streamrl_gateway_released_tasks_total", "Tasks handed back to the group on drain", registry=metrics.registry
    )
    g_failovers = Gauge(
        "streamrl_gateway_failovers_total", "Session moves off a dead generator", registry=metrics.registry
    )

    @app.post(
        "/sessions/{session_id}/v1/chat/completions",
        dependencies=agent_auth,
        openapi_extra=json_body(ChatCompletionRequest),
    )
    async def chat(session_id: str, request: Request) -> Response:
        req = await read_body(request, ChatCompletionRequest)
        body = await app.state.proxy.chat(session_id, req)
        return Response(body, media_type="application/json")

    @app.post(
        "/sessions/{session_id}/v1/completions", dependencies=agent_auth, openapi_extra=json_body(CompletionRequest)
    )
    async def completions(session_id: str, request: Request) -> Response:
        req = await read_body(request, CompletionRequest)
        body = await app.state.proxy.completion(session_id, req)
        return Response(body, media_type="application/json")

    @app.get("/sessions/{session_id}/v1/models", dependencies=agent_auth)
    async def models(session_id: str) -> Response:
        s = app.state.proxy.session(session_id)
        async with app.state.proxy.http.get(f"{s.generator_url}/v1/models") as resp:
            return Response(await resp.read(), status_code=resp.status, media_type="application/json")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        task = getattr(app.state, "loop_task", None)
        ok = task is not None and not task.done()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        worker, proxy = app.state.worker, app.state.proxy
        g_active.set(len(worker.active))
        g_calls.set(proxy.calls_total)
        for env, n in proxy.prefix_breaks_by_env.items():
            g_breaks.labels(env=env).set(n)
        g_failovers.set(proxy.failovers_total)
        g_released.set(worker.released)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    document_bodies(app)
    return app


def _die_loudly(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.critical("gateway worker loop died: %r; exiting", exc)
        os._exit(1)
    else:
        # The run ended (stop key): ask uvicorn to shut down by signalling ourselves.
        os.kill(os.getpid(), 15)

"""One lifecycle for every service (generator, gym gateway, trainer).

Every service is a FastAPI app built the same way:

    __main__:   parse the command line, load the config, then import the heavy libraries
    build_app(cfg, ...):  construct the components (no I/O), keep them on ``app.state``, mount the
                route modules and the probes (`add_probe_routes`), attach a `ServiceLifecycle`
    lifespan:   open the components, start background tasks with `ServiceLifecycle.supervise`,
                yield, then stop the tasks and close the components (each bounded in time)
    drain(app): in the service's ``app.py`` (the trainer's is ``stop_run``): what the first
                SIGTERM does while the server still listens
    run_server: a `DrainFirstServer` around the app; returns the process exit code (the generator
                and the gym gateway through `serve_worker`)

A supervised task that raises fails the service loudly, the same way everywhere: its traceback is
logged, the service's failure hooks run (its state becomes "failed" with the error, its heartbeat
says so at once), ``/ready`` answers 503, and the server drains and stops with exit code 1. A
service that cannot serve exits non-zero, so the restart policies of compose, Kubernetes or
``streamrl up`` act (crash-only) instead of a process lingering unready. A task started with
``ends_service=True`` (the trainer's run, a gateway's task loop) that returns asks for the same
drain-first shutdown with exit code 0.

The drain-first server: uvicorn's own shutdown closes the listening socket first, then waits for
open requests, then runs the lifespan shutdown. A gateway's environments reach the model through
the gateway's own session proxy and a multi-turn rollout opens new connections between turns, so
draining in the lifespan is too late; a generator being scaled down must likewise keep serving the
sessions it already has. So, on the first SIGTERM or SIGINT (or a `ServiceLifecycle.request_exit`)
the server runs the service's ``drain()`` while still serving, bounded by ``drain_timeout_s``,
then shuts down as uvicorn does. A second signal skips the rest of the drain.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from types import FrameType
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from shared.admin_api import Readiness
from shared.http import MsgspecJSON
from shared.metrics import CONTENT_TYPE
from shared.netaddr import advertise_address
from shared.tasks import bounded, cancel_and_wait

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
TASK_STOP_TIMEOUT_S = 5.0


class ServiceLifecycle:
    """A service's background tasks, its failure and its exit code; one per app (``app.state.lifecycle``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.error: str | None = None
        self.exit_code: int | None = None  # decided once: the first failure or exit request wins
        self._failure_hooks: list[Callable[[str], None]] = []
        self._exit_hook: Callable[[], None] | None = None  # the server's shutdown, once one runs the app

    @property
    def failed(self) -> bool:
        return self.error is not None

    def on_failure(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(error)`` when the service fails (mark a component failed, beat a heartbeat)."""
        self._failure_hooks.append(hook)

    def supervise(self, name: str, coro: Coroutine[Any, Any, Any], *, ends_service: bool = False) -> asyncio.Task[Any]:
        """Run ``coro`` as a background task: if it raises, the service fails; if it returns and
        ``ends_service``, the service stops cleanly."""
        task = asyncio.create_task(coro, name=name)
        self.tasks[name] = task
        task.add_done_callback(lambda t: self._task_done(name, t, ends_service))
        return task

    def _task_done(self, name: str, task: asyncio.Task[Any], ends_service: bool) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.critical("%s: background task %s died", self.name, name, exc_info=exc)
            self.fail(f"{name} died: {type(exc).__name__}: {exc}")
        elif ends_service:
            log.info("%s: %s finished; stopping", self.name, name)
            self.request_exit(EXIT_OK)

    def fail(self, error: str) -> None:
        """Fail the service: hooks run, /ready answers 503, the server stops with exit code 1."""
        if self.error is None:
            self.error = error
            for hook in self._failure_hooks:
                try:
                    hook(error)
                except Exception:
                    log.exception("%s: failure hook %r failed", self.name, hook)
        self.request_exit(EXIT_FAILED)

    def request_exit(self, code: int) -> None:
        """Stop the service (drain first) with ``code``, unless an earlier request decided it."""
        if self.exit_code is None:
            self.exit_code = code
        if self._exit_hook is not None:
            self._exit_hook()

    def attach_server(self, begin_shutdown: Callable[[], None]) -> None:
        self._exit_hook = begin_shutdown
        if self.exit_code is not None:  # decided before the server started listening
            begin_shutdown()

    async def stop_tasks(self, timeout_s: float = TASK_STOP_TIMEOUT_S) -> None:
        """Stop every task within ``timeout_s`` (`shared.tasks.cancel_and_wait`: a cancel can be
        lost inside the Redis client, so it is repeated)."""
        stuck = await cancel_and_wait(self.tasks.values(), timeout_s=timeout_s)
        for task in stuck:
            log.warning("%s: task %s did not stop within %.0fs", self.name, task.get_name(), timeout_s)


def freeze_startup_objects() -> int:
    """Exempt what exists once a service has started (modules, classes, functions, its clients:
    about 100,000 objects in the gym gateway) from every later garbage collection, and return how
    many. Each full collection otherwise walks them all again: 50-70 ms of a stalled event loop,
    measured at 1,024 sessions, every call in flight waiting on it. Objects freed by their last
    reference still go at once; only cycles among them would stay."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def add_probe_routes(
    app: FastAPI, readiness: Callable[[], Readiness], render_metrics: Callable[[], Awaitable[bytes]]
) -> None:
    """``GET /health`` (the process answers), ``GET /ready`` (`Readiness`; 503 unless ready and not
    failed) and ``GET /metrics`` (Prometheus text). All three stay open: probes and scrapers
    carry no token."""
    lifecycle: ServiceLifecycle = app.state.lifecycle

    async def health() -> MsgspecJSON:
        return MsgspecJSON({"status": "ok"})

    async def ready() -> MsgspecJSON:
        body = readiness()
        if lifecycle.failed:
            body = msgspec.structs.replace(body, ready=False, state="failed", error=lifecycle.error)
        return MsgspecJSON(body, status_code=200 if body.ready else 503)

    async def metrics() -> Response:
        return Response(await render_metrics(), media_type=CONTENT_TYPE)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route(
        "/ready",
        ready,
        methods=["GET"],
        responses={503: {"description": "not ready: starting, failed or draining"}},
        openapi_extra=_json_response(Readiness),
    )
    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        response_class=Response,
        openapi_extra={
            "responses": {
                "200": {
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            }
        },
    )


def _json_response(cls: type) -> dict[str, Any]:
    schema = msgspec.json.schema(cls)
    return {"responses": {"200": {"description": "ready", "content": {"application/json": {"schema": schema}}}}}


class DrainFirstServer(uvicorn.Server):
    """uvicorn, but the first signal (or `begin_shutdown`) runs ``drain()`` while still serving."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[object]], drain_timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._drain_signal: int | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._asked_from_inside = False  # begin_shutdown, not a signal: no signal to re-raise at the end

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler: only flags here; the drain starts on the loop's next tick.
        if self._drain_signal is None and not self.should_exit:
            self._drain_signal = sig
            return
        super().handle_exit(sig, frame)

    def begin_shutdown(self) -> None:
        """Drain, then stop: what the first SIGTERM does, asked for from inside the service."""
        if self._drain_signal is None and not self.should_exit:
            self._asked_from_inside = True
            self._drain_signal = signal.SIGTERM

    async def on_tick(self, counter: int) -> bool:
        if self._drain_signal is not None and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit(), name="drain")
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await bounded(self._drain(), "the drain (shutting down anyway)", self._drain_timeout_s)
        finally:
            if self._asked_from_inside:
                self.should_exit = True
            else:  # uvicorn re-raises the signal once shut down: the parent sees it ended by the signal
                super().handle_exit(self._drain_signal or signal.SIGTERM, None)


def bind(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound before the app is built so that ``port`` 0 (any free
    port) gives the port the service registers and advertises."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def advertised_url(host: str, port: int, redis_url: str | None = None) -> str:
    """The URL other processes reach a service at: a wildcard bind address becomes this host's
    advertised address (`shared.netaddr.advertise_address`: given, or the interface that reaches
    the run's Redis)."""
    if host in ("", "0.0.0.0", "::"):
        host = advertise_address(redis_url)
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def run_server(
    app: FastAPI,
    config: uvicorn.Config,
    *,
    drain: Callable[[], Awaitable[object]],
    drain_timeout_s: float,
    sockets: list[Any] | None = None,
) -> int:
    """Serve ``app`` until a signal or the service itself ends it; the process exit code: the
    lifecycle's decision (0 when its work ended, 1 when it failed), or 1 when the lifespan could not
    start. After SIGTERM or SIGINT the process ends by that signal once it has drained (uvicorn
    re-raises it), so a parent sees how it ended."""
    lifecycle: ServiceLifecycle = app.state.lifecycle
    server = DrainFirstServer(config, drain, drain_timeout_s=drain_timeout_s)
    lifecycle.attach_server(server.begin_shutdown)
    server.run(sockets=sockets)
    if lifecycle.exit_code is not None:
        return lifecycle.exit_code
    return EXIT_OK if server.started else EXIT_FAILED


# Keep-alive well above the clients' idle expiry, so a pooled connection is never reused just as
# the server closes it (a ReadError on a healthy rollout).
WORKER_KEEP_ALIVE_S = 120


def serve_worker(
    app: FastAPI,
    sock: socket.socket,
    *,
    drain: Callable[[FastAPI], Awaitable[object]],
    drain_timeout_s: float,
    graceful_timeout_s: float,
    **uvicorn_options: Any,
) -> int:
    """Serve a worker service's ``app`` (a generator, a gym gateway) on ``sock`` (`bind`) with
    `run_server`: ``drain(app)`` runs at the first signal, bounded by ``drain_timeout_s``; uvicorn
    then waits up to ``graceful_timeout_s`` for open requests. The process exit code."""
    config = uvicorn.Config(
        app,
        lifespan="on",
        timeout_graceful_shutdown=int(graceful_timeout_s),
        timeout_keep_alive=WORKER_KEEP_ALIVE_S,
        **uvicorn_options,
    )
    return run_server(app, config, drain=lambda: drain(app), drain_timeout_s=drain_timeout_s, sockets=[sock])

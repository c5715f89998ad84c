"""The trainer service: `build_app` wires the control plane, its learner, metrics and REST routes.

    build_app(cfg):  learner (the backend from the `services.trainer.backends` registry) ->
                     control plane -> Prometheus metrics -> app with the routes and the probes
    lifespan:        tracing (`shared.tracing`, when on) -> loop-lag probe -> supervised task "run":
                     control.open() (loads the policy, restores the newest checkpoint) then
                     control.run(); supervised task "learner":
                     the learner's watch (a lost trainer rank fails the service)
                     ... the run ends: the service stops with exit code 0; it fails: exit code 1
    shutdown:        the run task is stopped (SIGTERM: `stop_run` cancels it first; the process
                     then ends by the signal), heartbeat and Redis closed, spans flushed

The REST API answers while the loop trains (training runs in a worker thread). Tests and
benchmarks pass a control plane of their own (``control=``), built around a learner and hooks of
their choosing, and ``run=False`` to serve the API without running the loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.trainer.backends import build_backend
from services.trainer.control_plane import ControlPlane, TrainerHooks
from services.trainer.learner import Learner, LocalLearner
from services.trainer.observe import TrainerMetrics
from services.trainer.routes import router
from shared import tracing
from shared.admin_api import Readiness
from shared.auth import AuthPolicy
from shared.http import install_error_handlers
from shared.openapi import document_bodies
from shared.run_config import RunConfig
from shared.service import ServiceLifecycle, add_probe_routes
from shared.tasks import bounded, cancel_and_wait

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 30.0


def build_app(
    cfg: RunConfig,
    *,
    worker_id: str,
    url: str,
    control: ControlPlane | None = None,
    learner: Learner | None = None,
    run: bool = True,
    auth: AuthPolicy | None = None,
) -> FastAPI:
    """The trainer app for ``cfg``; ``auth`` defaults to the token in the environment. The learner
    defaults to the backend in this process (rank 0 of many passes its `RankedLearner`)."""
    metrics = TrainerMetrics()
    if control is None:
        learner = learner or LocalLearner(lambda: build_backend(cfg))
        control = ControlPlane(cfg, learner, worker_id=worker_id, url=url, hooks=TrainerHooks())
    control.hooks.record_sinks.append(metrics.observe_record)
    metrics.count_dead_letters(lambda: control.streams)
    app = FastAPI(title="streamrl trainer", lifespan=_lifespan)
    s = app.state
    s.cfg, s.control, s.metrics, s.run_loop = cfg, control, metrics, run
    s.lifecycle = lifecycle = ServiceLifecycle("trainer")
    s.auth = auth if auth is not None else AuthPolicy.from_env()
    lifecycle.on_failure(control.fail)
    install_error_handlers(app)
    app.include_router(router)

    def readiness() -> Readiness:
        ok = control.weight_version >= 0 and control.error is None
        return Readiness(
            ready=ok, state=control.state.value, error=control.error, weight_version=control.weight_version
        )

    async def render_metrics() -> bytes:
        metrics.update_from_control(control)
        await metrics.update_from_redis(control.redis, control.keys)
        return metrics.render()

    add_probe_routes(app, readiness, render_metrics)
    document_bodies(app)
    return app


async def _open_and_run(control: ControlPlane) -> None:
    await control.open()
    await control.run()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    s = app.state
    traced = tracing.setup(
        s.cfg.tracing, service="trainer", worker_id=s.control.worker_id, output_dir=s.cfg.run.output_dir
    )
    s.metrics.start_loop_lag_probe()
    if s.run_loop:
        s.lifecycle.supervise("run", _open_and_run(s.control), ends_service=True)
        s.lifecycle.supervise("learner", s.control.learner.watch())
    try:
        yield
    finally:
        await s.lifecycle.stop_tasks()
        await bounded(s.control.aclose(), "trainer close", _CLOSE_TIMEOUT_S)
        await s.metrics.aclose()
        if traced:
            tracing.shutdown()  # the spans still queued are written


async def stop_run(app: FastAPI) -> None:
    """The trainer's drain on SIGTERM: stop the run at once (a restart resumes from the newest
    checkpoint; unacknowledged trajectories are delivered again)."""
    task = app.state.lifecycle.tasks.get("run")
    if task is None or task.done():
        return
    # The run's own cleanup (the intake stopped, the reward curve drawn) gets a grace period
    # before the cancel is repeated.
    if await cancel_and_wait([task], timeout_s=_CLOSE_TIMEOUT_S, grace_s=_CLOSE_TIMEOUT_S / 3):
        log.warning("the run did not stop within %.0fs", _CLOSE_TIMEOUT_S)

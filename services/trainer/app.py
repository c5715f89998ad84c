"""The trainer's REST API: status, pause/resume, validation requests, health and metrics.

    POST /pause               -> {"epoch": E}        launch gate closed, training stops at the next
                                                      step boundary
    POST /resume  {"epoch"?}  -> {"resumed": bool}   ends pause E (or the active user pause); a
                                                      stale epoch is refused with 409
    POST /validate            -> {"validation_id", "at_step"}   runs at the next step boundary
    GET  /status              -> JSON status (step, buffer depth per target, staleness, workers...)
    GET  /health, /ready, /metrics

Built by `build_app` around a TrainerRuntime (which owns all state); started by __main__.
"""

from __future__ import annotations


import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Gauge

from shared.http import HTTPError, decode_body, install_error_handlers
from shared.metrics import CONTENT_TYPE, ServiceMetrics
from services.trainer.runtime import TrainerRuntime


class ResumeRequest(msgspec.Struct, forbid_unknown_fields=True):
    epoch: int | None = None


class _Gauges:
    def __init__(self, metrics: ServiceMetrics) -> None:
        r = metrics.registry
        self.step = Gauge("streamrl_trainer_step", "Current training step", registry=r)
        self.version = Gauge("streamrl_trainer_weight_version", "Last confirmed weight version", registry=r)
        self.buffer = Gauge("streamrl_trainer_buffer_groups", "Complete groups staged, by target offset", ["offset"], registry=r)
        self.in_flight = Gauge("streamrl_trainer_in_flight_groups", "Groups issued and not yet complete", registry=r)
        self.evicted = Gauge("streamrl_trainer_evicted_groups_total", "Groups evicted as stale", registry=r)
        self.reward = Gauge("streamrl_trainer_reward_mean", "Mean reward of the last step", registry=r)
        self.staleness = Gauge("streamrl_trainer_staleness_mean", "Mean age of the last step's groups", registry=r)
        self.refit = Gauge("streamrl_trainer_refit_seconds", "Duration of the last refit", registry=r)
        self.deadletter = Gauge("streamrl_trainer_deadlettered_total", "Entries dead-lettered by the trainer", registry=r)

    def update(self, rt: TrainerRuntime) -> None:
        self.step.set(rt.step)
        self.version.set(rt.weight_version)
        self.buffer.clear()
        for target, n in rt.buffer.depth_by_target().items():
            self.buffer.labels(offset=str(target - rt.step)).set(n)
        self.in_flight.set(rt.scheduler.in_flight_count())
        self.evicted.set(rt.buffer.evicted_total)
        self.deadletter.set(rt.streams.deadlettered)
        last = rt.last_metrics
        if last:
            self.reward.set(last["reward_mean"])
            self.staleness.set(last["staleness_mean"])
            self.refit.set(last["time_refit_s"])


def build_app(runtime: TrainerRuntime, metrics: ServiceMetrics) -> FastAPI:
    app = FastAPI(title="streamrl trainer")
    install_error_handlers(app)
    app.state.runtime = runtime
    gauges = _Gauges(metrics)

    def ready_runtime() -> TrainerRuntime:
        if not hasattr(runtime, "buffer"):
            raise HTTPError(503, "trainer is still starting")
        return runtime

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = runtime.weight_version >= 0 and runtime.error is None
        return JSONResponse({"ready": ok, "state": runtime.state}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status() -> dict:
        return await ready_runtime().status()

    @app.post("/pause")
    async def pause() -> dict:
        epoch = await ready_runtime().pause.pause("user")
        return {"epoch": epoch}

    @app.post("/resume")
    async def resume(request: Request) -> dict:
        rt = ready_runtime()
        body = await request.body()
        req = decode_body(body, ResumeRequest) if body.strip() else ResumeRequest()
        active = (await rt.pause.reasons()).get("user")
        if active is None:
            return {"resumed": False, "reason": "not paused"}
        epoch = active if req.epoch is None else req.epoch
        if not await rt.pause.resume("user", epoch):
            raise HTTPError(409, f"pause epoch {epoch} is not the active pause (active: {active})", param="epoch")
        return {"resumed": True, "epoch": epoch}

    @app.post("/validate")
    async def validate() -> dict:
        rt = ready_runtime()
        if rt.validator is None:
            raise HTTPError(400, "no validation data: set data.val_path", param="data.val_path")
        vid = rt.request_validation()
        return {"validation_id": vid, "at_step": rt.step, "status": "queued", "result_url": f"/validations/{vid}"}

    @app.get("/validations/{validation_id}")
    async def validation(validation_id: str) -> dict:
        entry = runtime.validations.get(validation_id)
        if entry is None:
            raise HTTPError(404, f"no validation {validation_id!r}", param="validation_id")
        return entry

    @app.get("/metrics")
    async def prometheus() -> Response:
        if hasattr(runtime, "buffer"):
            gauges.update(runtime)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app

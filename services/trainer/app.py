"""The trainer's REST API: status, pause/resume, validation requests, health and metrics.

    POST /pause               -> {"epoch": E}        launch gate closed, training stops at the next
                                                      step boundary
    POST /resume  {"epoch"?}  -> {"resumed": bool}   ends pause E (or the active user pause); a
                                                      stale epoch is refused with 409
    POST /validate            -> {"validation_id", "at_step"}   runs at the next step boundary
    GET  /status              -> JSON status (step, buffer depth per target, staleness, workers...)
    GET  /validations/<id>    -> a requested validation's state and result
    GET  /health, /ready, /metrics   (open: probes and scrapes)

Every other route is a control route: with an API token set it requires the bearer token
(`shared.http.require_control_token`).

Built by `build_app` around a TrainerRuntime (which owns all state); started by __main__.
"""

from __future__ import annotations

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.trainer.observe import TrainerMetrics
from services.trainer.runtime import TrainerRuntime
from shared.auth import AuthPolicy
from shared.http import HTTPError, decode_body, install_error_handlers, require_control_token
from shared.metrics import CONTENT_TYPE
from shared.openapi import document_bodies, json_body
from shared.pause import PauseReason

CONTROL = [Depends(require_control_token)]


class ResumeRequest(msgspec.Struct, forbid_unknown_fields=True):
    epoch: int | None = None


def build_app(
    runtime: TrainerRuntime, metrics: TrainerMetrics | None = None, *, auth: AuthPolicy | None = None
) -> FastAPI:
    """The REST app around ``runtime``; ``auth`` defaults to the token in the environment."""
    metrics = metrics if metrics is not None else TrainerMetrics()
    runtime.record_sinks.append(metrics.observe_record)
    metrics.count_dead_letters(lambda: getattr(runtime, "streams", None))
    app = FastAPI(title="streamrl trainer")
    install_error_handlers(app)
    app.state.runtime, app.state.metrics = runtime, metrics
    app.state.auth = auth if auth is not None else AuthPolicy.from_env()

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

    @app.get("/status", dependencies=CONTROL)
    async def status() -> dict:
        return await ready_runtime().status()

    @app.post("/pause", dependencies=CONTROL)
    async def pause() -> dict:
        epoch = await ready_runtime().pause.pause(PauseReason.USER)
        return {"epoch": epoch}

    @app.post("/resume", dependencies=CONTROL, openapi_extra=json_body(ResumeRequest, required=False))
    async def resume(request: Request) -> dict:
        rt = ready_runtime()
        body = await request.body()
        req = decode_body(body, ResumeRequest) if body.strip() else ResumeRequest()
        active = (await rt.pause.reasons()).get("user")
        if active is None:
            return {"resumed": False, "reason": "not paused"}
        epoch = active if req.epoch is None else req.epoch
        if not await rt.pause.resume(PauseReason.USER, epoch):
            raise HTTPError(409, f"pause epoch {epoch} is not the active pause (active: {active})", param="epoch")
        return {"resumed": True, "epoch": epoch}

    @app.post("/validate", dependencies=CONTROL)
    async def validate() -> dict:
        rt = ready_runtime()
        if rt.validator is None:
            raise HTTPError(400, "no validation data: set data.val_path", param="data.val_path")
        vid = rt.request_validation()
        return {"validation_id": vid, "at_step": rt.step, "status": "queued", "result_url": f"/validations/{vid}"}

    @app.get("/validations/{validation_id}", dependencies=CONTROL)
    async def validation(validation_id: str) -> dict:
        entry = runtime.validations.get(validation_id)
        if entry is None:
            raise HTTPError(404, f"no validation {validation_id!r}", param="validation_id")
        return entry

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.update_from_runtime(runtime)
        if hasattr(runtime, "redis"):
            await metrics.update_from_redis(runtime.redis, runtime.keys)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    document_bodies(app)
    return app

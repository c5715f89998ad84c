"""The trainer's REST routes (control routes: with an API token set they require the bearer token,
`shared.http.require_control_token`; the probes are `shared.service.add_probe_routes`):

    POST /pause               -> PauseAnswer {epoch}       the launch gate closes; the run holds at the
                                                            next step boundary
    POST /resume  {"epoch"?}  -> ResumeAnswer              ends pause E (or the active user pause); a
                                                            stale epoch is refused with 409
    POST /validate            -> ValidationAccepted        runs at the next step boundary (or before
                                                            the run ends); 409 once the run has ended
    GET  /status              -> TrainerStatus             step, buffer depth per target, staleness, workers...
    GET  /validations/<id>    -> ValidationStatus          a validation's state and result

Answers are the msgspec Structs of `shared.records`. Mounted by `services.trainer.app`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from services.trainer.control_plane import ControlPlane
from services.trainer.validation_control import ValidationRefused
from shared.http import HTTPError, MsgspecJSON, decode_body, require_control_token
from shared.openapi import json_body
from shared.pause import PauseReason
from shared.records import PauseAnswer, ResumeAnswer, ResumeRequest

router = APIRouter(dependencies=[Depends(require_control_token)])


def _control(request: Request) -> ControlPlane:
    control: ControlPlane = request.app.state.control
    return control


@router.get("/status")
async def status(request: Request) -> MsgspecJSON:
    return MsgspecJSON(await _control(request).status())


@router.post("/pause")
async def pause(request: Request) -> MsgspecJSON:
    epoch = await _control(request).pause.pause(PauseReason.USER)
    return MsgspecJSON(PauseAnswer(epoch=epoch))


@router.post("/resume", openapi_extra=json_body(ResumeRequest, required=False))
async def resume(request: Request) -> MsgspecJSON:
    control = _control(request)
    body = await request.body()
    req = decode_body(body, ResumeRequest) if body.strip() else ResumeRequest()
    holding = await control.pause.holding()  # a user pause, a pause for infrastructure failures
    if not holding:
        return MsgspecJSON(ResumeAnswer(resumed=False, reason="not paused"))
    if req.epoch is None:
        ended = [epoch for reason, epoch in holding.items() if await control.pause.resume(reason, epoch)]
        return MsgspecJSON(ResumeAnswer(resumed=bool(ended), epoch=max(ended, default=None)))
    reason = next((r for r, e in holding.items() if e == req.epoch), None)
    if reason is None or not await control.pause.resume(reason, req.epoch):
        active = ", ".join(f"{r.value} {e}" for r, e in holding.items())
        raise HTTPError(409, f"pause epoch {req.epoch} is not an active pause (active: {active})", param="epoch")
    return MsgspecJSON(ResumeAnswer(resumed=True, epoch=req.epoch))


@router.post("/validate")
async def validate(request: Request) -> MsgspecJSON:
    control = _control(request)
    try:
        return MsgspecJSON(control.validation.request(control.step))
    except ValidationRefused as exc:
        status = 400 if exc.param == "data.val_path" else 409
        raise HTTPError(status, str(exc), param=exc.param) from None


@router.get("/validations/{validation_id}")
async def validation(validation_id: str, request: Request) -> MsgspecJSON:
    entry = _control(request).validation.statuses.get(validation_id)
    if entry is None:
        raise HTTPError(404, f"no validation {validation_id!r}", param="validation_id")
    return MsgspecJSON(entry)

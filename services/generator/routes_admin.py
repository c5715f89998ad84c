"""The generator's admin routes (`shared.admin_api` messages); the probes /health, /ready and
/metrics are the shared ones (`shared.service.add_probe_routes`, mounted by the app).

* ``POST /admin/pause {mode}``, ``POST /admin/resume``: pause reason `LocalPause.ADMIN` (a refit
  keeps its own).
* ``POST /admin/load_weights {version, path, checksum, mode}``: the watcher's code path
  (`WeightSync.apply`), acked on the weight_acks stream as well; 500 naming the error on failure.
  A ``path`` without safetensors files is a 400 that leaves the generator serving.
* ``POST /admin/reset_prefix_cache``: the engine's answer.
* ``GET /admin/state``: `shared.admin_api.GeneratorState`.

Every route here requires the API token when one is set (`shared.auth`).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from starlette.datastructures import State

from services.generator.runtime import LocalPause, Runtime
from services.generator.weights import LoadOrder
from shared.admin_api import GeneratorState, LoadWeightsRequest, PauseRequest
from shared.http import HTTPError, MsgspecJSON, bad_request, read_body, require_control_token
from shared.openapi import json_body
from shared.weights_format import safetensors_files

router = APIRouter()
CONTROL = [Depends(require_control_token)]


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


@router.get("/admin/state", dependencies=CONTROL)
async def state(request: Request) -> MsgspecJSON:
    return MsgspecJSON(generator_state(request.app.state))


@router.post("/admin/pause", dependencies=CONTROL, openapi_extra=json_body(PauseRequest))
async def pause(request: Request) -> MsgspecJSON:
    body = await read_body(request, PauseRequest)
    await _runtime(request).pause(LocalPause.ADMIN, body.mode)
    return MsgspecJSON(generator_state(request.app.state))


@router.post("/admin/resume", dependencies=CONTROL)
async def resume(request: Request) -> MsgspecJSON:
    await _runtime(request).resume(LocalPause.ADMIN)
    return MsgspecJSON(generator_state(request.app.state))


@router.post("/admin/load_weights", dependencies=CONTROL, openapi_extra=json_body(LoadWeightsRequest))
async def load_weights(request: Request) -> MsgspecJSON:
    body = await read_body(request, LoadWeightsRequest)
    try:  # a wrong path is the caller's error: refused before the load can take the generator out of service
        await asyncio.to_thread(safetensors_files, body.path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise bad_request(f"path: {exc}", param="path") from None
    order = LoadOrder(version=body.version, path=body.path, checksum=body.checksum, mode=body.mode)
    ack = await request.app.state.weights.apply(order)
    if not ack.ok:
        raise HTTPError(500, ack.error or "weight load failed", type_="weight_load_error")
    return MsgspecJSON(ack)


@router.post("/admin/reset_prefix_cache", dependencies=CONTROL)
async def reset_prefix_cache(request: Request) -> MsgspecJSON:
    rt = _runtime(request)
    ok = await rt.engine.reset_prefix_cache()
    if ok:
        rt.prefix_cache_resets += 1
        request.app.state.metrics.prefix_cache_resets.inc()
    return MsgspecJSON({"success": ok, "prefix_caching_enabled": rt.engine.prefix_caching_enabled})


def generator_state(state: State) -> GeneratorState:
    """The /admin/state answer from the app's state objects."""
    rt: Runtime = state.runtime
    stats = rt.engine.stats()
    info = rt.engine.info
    return GeneratorState(
        worker_id=rt.worker_id,
        state=rt.state,
        weight_version=rt.weight_version,
        engine=info.name,
        model=info.model,
        in_flight=rt.in_flight,
        running=stats.running,
        waiting=rt.waiting + stats.waiting,
        requests_total=rt.requests_total,
        generated_tokens_total=stats.generated_tokens_total,
        tokens_per_s=rt.tokens_per_s(),
        prefix_cache_resets=rt.prefix_cache_resets,
        last_refit_s=rt.last_refit_s,
        error=rt.error,
    )

"""The session API for external agents (`services.gym_gateway.external`): control routes, so with
an API token set they need ``Authorization: Bearer <token>`` (`shared.http.require_control_token`).

    POST /sessions                  -> 200 SessionGrant: the next task of environment ``external``
                                       waiting for an agent (its session's OpenAI base URL, the
                                       complete URL, the instance, the sampling, the deadline);
                                       204 when none waits, the launch gate is closed or the
                                       worker drains; 503 when the claimed session could not start
    POST /sessions/<id>/complete    -> 200 Completed {"reward", "mask_sample"?, "metrics"?}: the
                                       outcome is taken and the rollout is published with it;
                                       400 naming the field; 404 unknown session; 409 when the
                                       session already took an outcome or has ended

A worker of several with no task waiting asks the others for one (``x-streamrl-forwarded`` stops
a second hop), so agents may call any worker; a grant names the worker that holds its session,
and a complete sent elsewhere is forwarded to it (`services.gym_gateway.forwarding`). Mounted by
`services.gym_gateway.app.build_app`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from services.gym_gateway.external import CompleteRequest, ExternalSessions
from services.gym_gateway.forwarding import FORWARDED_HEADER, SessionForwarder, ask_peer, peer_urls
from services.gym_gateway.proxy import SessionProxy
from services.gym_gateway.worker import GatewayWorker
from shared.auth import AuthPolicy, client_headers
from shared.http import MsgspecJSON, read_body, require_control_token
from shared.openapi import json_body

router = APIRouter(dependencies=[Depends(require_control_token)])
_NO_TASK = {"description": "no external task waits for an agent (or the launch gate is closed): ask again later"}
_NOT_STARTED = {
    "description": "the claimed task's session could not start (no serving generator)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


def _worker(request: Request) -> GatewayWorker:
    worker: GatewayWorker = request.app.state.worker
    return worker


@router.post("/sessions", responses={204: _NO_TASK, 503: _NOT_STARTED})
async def claim(request: Request) -> Response:
    worker = _worker(request)
    if worker.stopping or await worker.gate_closed():
        return Response(status_code=204)
    grant = await worker.external.claim()
    if grant is not None:
        return MsgspecJSON(grant)
    return await _claim_elsewhere(request) or Response(status_code=204)


async def _claim_elsewhere(request: Request) -> Response | None:
    """Another live gateway worker's grant, when this one has no task waiting; None if none has."""
    if request.headers.get(FORWARDED_HEADER):
        return None
    proxy: SessionProxy = request.app.state.proxy
    auth: AuthPolicy = request.app.state.auth
    headers = {FORWARDED_HEADER: "1", **client_headers(auth.token)}
    for url in await peer_urls(proxy, request.app.state.worker_id):
        got = await ask_peer(proxy, "POST", f"{url.rstrip('/')}/sessions", headers)
        if got is not None and got[0] == 200:  # unreachable: a worker that went away holds no task
            return Response(got[1], media_type="application/json")
    return None


@router.post("/sessions/{session_id}/complete", openapi_extra=json_body(CompleteRequest))
async def complete(session_id: str, request: Request) -> Response:
    outcome = (await read_body(request, CompleteRequest)).outcome()
    external: ExternalSessions = _worker(request).external
    if not external.holds(session_id):
        forwarder: SessionForwarder = request.app.state.forwarder
        return await forwarder.forward(request, session_id, request.app.state.proxy)
    return MsgspecJSON(await external.complete(session_id, outcome))

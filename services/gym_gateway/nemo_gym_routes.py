"""NeMo-Gym's model-server surface on the gateway, one per rollout.

To a NeMo-Gym agent the gateway is the policy's *model server* (a ``responses_api_models`` entry
in the NeMo-Gym config whose host and port are the gateway's). NeMo-Gym routes a rollout's model
calls by path: with ``observability_enabled`` (or training token capture) an agent handling
``/run`` with ``_ng_rollout_id: <id>`` sends them to ``/ng-rollout/<id>/v1/...`` (capture:
``/ng-rollout/<id>/training-token-capture/v1/...``). The NeMo-Gym driver sets ``<id>`` to the
rollout's session id, so these paths are the session's own:

    POST /sessions/{id}/v1/responses  and  /ng-rollout/{id}[/training-token-capture]/v1/responses
         Responses API (non-streaming), converted to the session's chat path (recorded, spliced)
    POST /ng-rollout/{id}[/training-token-capture]/v1/chat/completions, .../v1/completions
    GET  /ng-rollout/{id}[/training-token-capture]/v1/models
         the session's own paths, for agents and model adapters that speak chat or completions
    POST /sessions/{id}/tokenize  and  /ng-rollout/{id}[/training-token-capture]/tokenize
         the session generator's /tokenize (NeMo-Gym's vllm_model calls it for prompt ids)
    GET  /sessions/{id}/stats         model calls the session recorded (the driver's routing check)
    POST /v1/responses                a 404 that says the rollout prefix is missing

A NeMo-Gym config names one model server, but a run may have several gateway workers, each holding
the sessions of the rollouts it runs. A call for a session this worker does not hold is forwarded
to the live gateway worker (from the registry) that holds it, once (``x-streamrl-forwarded``);
the owner found is remembered for the session's next calls.

Registered on the gateway app by `services.gym_gateway.app`; the work is done by
`services.gym_gateway.responses` and the app's `SessionProxy`.
"""

from __future__ import annotations

from collections import OrderedDict

import aiohttp
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gym_gateway.responses import build_response, chat_request
from shared.http import HTTPError, MsgspecJSON, read_body
from shared.openai_api import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, TokenizeRequest
from shared.openapi import json_body
from shared.registry import live_workers
from shared.responses_api import ResponsesRequest

ROLLOUT_PREFIX = "/ng-rollout/{session_id}"
CAPTURE_PREFIX = "/ng-rollout/{session_id}/training-token-capture"
_PREFIXES = ("/sessions/{session_id}", ROLLOUT_PREFIX, CAPTURE_PREFIX)

FORWARDED_HEADER = "x-streamrl-forwarded"
MAX_REMEMBERED_OWNERS = 4096

router = APIRouter()
_chat_decoder = msgspec.json.Decoder(ChatCompletionResponse)


class SessionStats(msgspec.Struct, kw_only=True):
    session_id: str
    calls: int
    prefix_breaks: int


def _unknown(session_id: str) -> HTTPError:
    return HTTPError(404, f"unknown or finished session {session_id!r}", param="session_id")


def _session(request: Request, session_id: str):
    s = request.app.state.proxy.sessions.get(session_id)
    if s is None:
        raise _unknown(session_id)
    return s


async def _forwarded(request: Request, session_id: str) -> Response | None:
    """The answer of the gateway worker holding ``session_id`` when this one does not; None when
    this worker holds it. A 404 when no live worker does."""
    app = request.app
    if session_id in app.state.proxy.sessions:
        return None
    if request.headers.get(FORWARDED_HEADER):
        raise _unknown(session_id)
    owners: OrderedDict[str, str] | None = getattr(app.state, "session_owners", None)
    if owners is None:
        owners = app.state.session_owners = OrderedDict()
    proxy = app.state.proxy
    candidates = (
        [owners[session_id]]
        if session_id in owners
        else [
            w.url
            for w in await live_workers(proxy.pool.redis, proxy.pool.keys, "gym_gateway")
            if w.worker_id != app.state.worker.gateway_id
        ]
    )
    body = await request.body()
    headers = {"content-type": request.headers.get("content-type", "application/json"), FORWARDED_HEADER: "1"}
    for url in candidates:
        try:
            async with proxy.http.request(
                request.method,
                f"{url.rstrip('/')}{request.url.path}",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=proxy.request_timeout_s),
            ) as resp:
                status, answer = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            continue  # a worker that went away holds no session we can reach
        if status == 404 and b'"session_id"' in answer:
            continue
        owners[session_id] = url
        while len(owners) > MAX_REMEMBERED_OWNERS:
            owners.popitem(last=False)
        return Response(answer, status_code=status, media_type="application/json")
    owners.pop(session_id, None)
    raise _unknown(session_id)


async def responses(session_id: str, request: Request) -> Response:
    if (elsewhere := await _forwarded(request, session_id)) is not None:
        return elsewhere
    req = await read_body(request, ResponsesRequest)
    body = await request.app.state.proxy.chat(session_id, chat_request(req))
    return MsgspecJSON(build_response(req, _chat_decoder.decode(body)))


async def chat(session_id: str, request: Request) -> Response:
    if (elsewhere := await _forwarded(request, session_id)) is not None:
        return elsewhere
    req = await read_body(request, ChatCompletionRequest)
    if req.stream:
        raise HTTPError(400, "streaming is not supported by the session proxy", param="stream")
    return Response(await request.app.state.proxy.chat(session_id, req), media_type="application/json")


async def completions(session_id: str, request: Request) -> Response:
    if (elsewhere := await _forwarded(request, session_id)) is not None:
        return elsewhere
    req = await read_body(request, CompletionRequest)
    if req.stream:
        raise HTTPError(400, "streaming is not supported by the session proxy", param="stream")
    return Response(await request.app.state.proxy.completion(session_id, req), media_type="application/json")


async def models(session_id: str, request: Request) -> Response:
    if (elsewhere := await _forwarded(request, session_id)) is not None:
        return elsewhere
    s = _session(request, session_id)
    async with request.app.state.proxy.http.get(f"{s.generator_url}/v1/models") as resp:
        return Response(await resp.read(), status_code=resp.status, media_type="application/json")


async def tokenize(session_id: str, request: Request) -> Response:
    """Forwarded as sent: replayed assistant messages carry their token fields, from which the
    generator splices exactly as it did for the chat call (the session's own history has moved
    on by then, so it is not attached here)."""
    if (elsewhere := await _forwarded(request, session_id)) is not None:
        return elsewhere
    s = _session(request, session_id)
    req = await read_body(request, TokenizeRequest)
    proxy = request.app.state.proxy
    try:
        async with proxy.http.post(
            f"{s.generator_url}/tokenize",
            data=msgspec.json.encode(req),
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=proxy.request_timeout_s),
        ) as resp:
            return Response(await resp.read(), status_code=resp.status, media_type="application/json")
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise HTTPError(502, f"generator {s.generator_id} unreachable: {type(exc).__name__}: {exc}") from exc


async def stats(session_id: str, request: Request) -> Response:
    if (elsewhere := await _forwarded(request, session_id)) is not None:
        return elsewhere
    s = _session(request, session_id)
    return MsgspecJSON(SessionStats(session_id=session_id, calls=s.calls, prefix_breaks=s.prefix_breaks))


async def no_rollout() -> None:
    raise HTTPError(
        404,
        "the gateway serves a model per rollout: call /ng-rollout/<rollout id>/v1/responses. "
        "Set observability_enabled: true in the NeMo-Gym config so agents add the prefix, and "
        "let the streamrl driver post /run (it sets _ng_rollout_id)",
        param="path",
    )


for _prefix in _PREFIXES:
    router.add_api_route(
        f"{_prefix}/v1/responses", responses, methods=["POST"], openapi_extra=json_body(ResponsesRequest)
    )
    router.add_api_route(f"{_prefix}/tokenize", tokenize, methods=["POST"], openapi_extra=json_body(TokenizeRequest))
for _prefix in (ROLLOUT_PREFIX, CAPTURE_PREFIX):
    router.add_api_route(
        f"{_prefix}/v1/chat/completions", chat, methods=["POST"], openapi_extra=json_body(ChatCompletionRequest)
    )
    router.add_api_route(
        f"{_prefix}/v1/completions", completions, methods=["POST"], openapi_extra=json_body(CompletionRequest)
    )
    router.add_api_route(f"{_prefix}/v1/models", models, methods=["GET"])
router.add_api_route("/sessions/{session_id}/stats", stats, methods=["GET"])
router.add_api_route("/v1/responses", no_rollout, methods=["POST"])

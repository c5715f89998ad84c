"""The session routes: one rollout's model endpoints, mounted at every prefix a client may use.

    /sessions/{session_id}                            an agent given the session's base URL (openhands)
    /ng-rollout/{session_id}                          NeMo-Gym agents (observability_enabled)
    /ng-rollout/{session_id}/training-token-capture   NeMo-Gym agents with training token capture

and under each prefix:

    POST /v1/chat/completions   OpenAI chat, recorded by the session proxy
    POST /v1/completions        OpenAI completions (text or token-id prompts), recorded
    POST /v1/responses          Responses API (non-streaming), converted to the session's chat call
                                (`services.gym_gateway.responses`)
    GET  /v1/models             the model list of the session's generator
    POST /tokenize              the session generator's /tokenize (NeMo-Gym's vllm_model asks it
                                for prompt ids)
    GET  /stats                 model calls and prefix breaks the session recorded (the NeMo-Gym
                                driver's routing check)

plus ``POST /v1/responses`` without a prefix: a 404 saying the rollout prefix is missing.

To a NeMo-Gym agent the gateway is the policy's model server (a ``responses_api_models`` entry
whose host and port are the gateway's); with ``observability_enabled`` (or training token capture)
an agent handling ``/run`` with ``_ng_rollout_id: <id>`` calls ``/ng-rollout/<id>/v1/...``, and the
NeMo-Gym driver sets ``<id>`` to the rollout's session id, so those paths are the session's own.

Every route decodes its body first (a 400 naming the field, wherever the session is), then hands
a call for a session this worker does not hold to the worker that does
(`services.gym_gateway.forwarding`). What a session cannot record (streaming, ``n`` > 1) is refused
by the proxy, for every path alike. Mounted by `services.gym_gateway.app.build_app`, behind the
agent token when ``auth.protect_agent_routes`` is set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gym_gateway.forwarding import SessionForwarder
from services.gym_gateway.proxy import Session, SessionProxy
from services.gym_gateway.responses import build_response, chat_request
from shared.http import HTTPError, MsgspecJSON, decode_body, read_body
from shared.netaddr import this_host
from shared.openai_api import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, TokenizeRequest
from shared.openapi import json_body
from shared.responses_api import ResponsesRequest

SESSION_PREFIXES = (
    "/sessions/{session_id}",
    "/ng-rollout/{session_id}",
    "/ng-rollout/{session_id}/training-token-capture",
)

session_router = APIRouter()  # one session's routes, relative to its prefix
_chat_decoder = msgspec.json.Decoder(ChatCompletionResponse)


class SessionStats(msgspec.Struct, kw_only=True):
    session_id: str
    calls: int
    prefix_breaks: int


def _proxy(request: Request) -> SessionProxy:
    proxy: SessionProxy = request.app.state.proxy
    return proxy


async def _elsewhere(request: Request, session_id: str) -> Response | None:
    """The owner's answer when another gateway worker holds ``session_id``; None when this one does."""
    proxy = _proxy(request)
    if session_id in proxy.sessions:
        return None
    forwarder: SessionForwarder = request.app.state.forwarder
    return await forwarder.forward(request, session_id, proxy)


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


async def _to_generator(proxy: SessionProxy, s: Session, method: str, path: str, body: bytes | None = None) -> Response:
    """The session generator's answer to a call the proxy does not record, passed through."""
    try:
        async with proxy.http.request(
            method,
            f"{s.generator_url}{path}",
            data=body,
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=proxy.request_timeout_s),
        ) as resp:
            return Response(await resp.read(), status_code=resp.status, media_type="application/json")
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise HTTPError(
            502, f"generator {s.generator_id} unreachable from host {this_host()}: {type(exc).__name__}: {exc}"
        ) from exc


async def _chat(proxy: SessionProxy, session_id: str, req: ChatCompletionRequest) -> bytes:
    return await proxy.chat(session_id, req)


async def _completions(proxy: SessionProxy, session_id: str, req: CompletionRequest) -> bytes:
    return await proxy.completion(session_id, req)


async def _responses(proxy: SessionProxy, session_id: str, req: ResponsesRequest) -> bytes:
    body = await proxy.chat(session_id, chat_request(req))
    return msgspec.json.encode(build_response(req, _chat_decoder.decode(body)))


@dataclass(frozen=True)
class ModelCall:
    """A recorded model call under a session prefix: its body's type and what answers it."""

    request: type[Any]
    answer: Callable[[SessionProxy, str, Any], Awaitable[bytes]]


# Path (relative to the session prefix) -> the call; served by these routes and, for a session
# this worker holds, by `services.gym_gateway.session_calls` in front of the framework.
MODEL_CALLS: dict[str, ModelCall] = {
    "/v1/chat/completions": ModelCall(ChatCompletionRequest, _chat),
    "/v1/completions": ModelCall(CompletionRequest, _completions),
    "/v1/responses": ModelCall(ResponsesRequest, _responses),
}


def _model_route(call: ModelCall) -> Callable[[str, Request], Awaitable[Response]]:
    async def route(session_id: str, request: Request) -> Response:
        req = decode_body(await request.body(), call.request)
        if (elsewhere := await _elsewhere(request, session_id)) is not None:
            return elsewhere
        return _json(await call.answer(_proxy(request), session_id, req))

    return route


for _path, _call in MODEL_CALLS.items():
    session_router.add_api_route(
        _path,
        _model_route(_call),
        methods=["POST"],
        openapi_extra=json_body(_call.request),
        name=_call.answer.__name__.lstrip("_"),
    )


@session_router.get("/v1/models")
async def models(session_id: str, request: Request) -> Response:
    if (elsewhere := await _elsewhere(request, session_id)) is not None:
        return elsewhere
    proxy = _proxy(request)
    return await _to_generator(proxy, proxy.session(session_id), "GET", "/v1/models")


@session_router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(session_id: str, request: Request) -> Response:
    """Forwarded as sent: replayed assistant messages carry their token fields, from which the
    generator splices exactly as it did for the chat call (the session's own history has moved
    on by then, so it is not attached here)."""
    req = await read_body(request, TokenizeRequest)
    if (elsewhere := await _elsewhere(request, session_id)) is not None:
        return elsewhere
    proxy = _proxy(request)
    s = proxy.session(session_id)
    return await _to_generator(proxy, s, "POST", "/tokenize", msgspec.json.encode(req))


@session_router.get("/stats")
async def stats(session_id: str, request: Request) -> Response:
    if (elsewhere := await _elsewhere(request, session_id)) is not None:
        return elsewhere
    s = _proxy(request).session(session_id)
    return MsgspecJSON(SessionStats(session_id=session_id, calls=s.calls, prefix_breaks=s.prefix_breaks))


async def no_rollout() -> None:
    raise HTTPError(
        404,
        "the gateway serves a model per rollout: call /ng-rollout/<rollout id>/v1/responses. "
        "Set observability_enabled: true in the NeMo-Gym config so agents add the prefix, and "
        "let the streamrl driver post /run (it sets _ng_rollout_id)",
        param="path",
    )


router = APIRouter()  # what the app mounts: the session routes at every prefix
for _prefix in SESSION_PREFIXES:
    router.include_router(session_router, prefix=_prefix)
router.add_api_route("/v1/responses", no_rollout, methods=["POST"])

"""The session model calls, answered in front of the framework.

At a thousand sessions per gateway worker whole batches of answers return at once, and every
call's share of the event loop is what the last agent waits for. Profiled at 1,024 sessions,
FastAPI's per-request work (matching the path against every route, solving the token dependency,
request objects, the exception layers) was about 40% of the gateway's CPU per call. `SessionCalls`
is a pure ASGI middleware that answers ``POST <session prefix>/v1/chat/completions``,
``/v1/completions`` and ``/v1/responses`` itself when this worker holds the session, with what the
routes do: the agent token (`shared.http.verify_bearer`), the body decoded into its type (a 400
naming the field), the same answer (`services.gym_gateway.session_routes.MODEL_CALLS`) and the
same error bodies (`shared.http.answer_error`). Everything else goes on to the app unchanged: a
session held by another worker (forwarded by the routes), an unknown session (their 404), a
forwarded call, every other route.

Installed by `services.gym_gateway.app.build_app` (``app.add_middleware``: inside the framework's
outermost error layer, which still turns an unexpected exception into a 500).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gym_gateway.forwarding import FORWARDED_HEADER
from services.gym_gateway.proxy import SessionProxy
from services.gym_gateway.session_routes import MODEL_CALLS, ModelCall
from shared.auth import AuthPolicy
from shared.http import HTTPError, answer_error, decode_body, verify_bearer

_JSON = (b"content-type", b"application/json")
_FORWARDED = FORWARDED_HEADER.encode()
_TAIL = "/training-token-capture"


def match(path: str) -> tuple[str, ModelCall] | None:
    """(session id, call) when ``path`` is a model call under a session prefix
    (`services.gym_gateway.session_routes.SESSION_PREFIXES`), else None."""
    if path.startswith("/sessions/"):
        rest, ng = path[10:], False
    elif path.startswith("/ng-rollout/"):
        rest, ng = path[12:], True
    else:
        return None
    session_id, slash, tail = rest.partition("/")
    if not session_id or not slash:
        return None
    tail = "/" + tail
    if ng and tail.startswith(_TAIL + "/"):
        tail = tail[len(_TAIL) :]
    call = MODEL_CALLS.get(tail)
    return (session_id, call) if call is not None else None


class SessionCalls:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and (hit := match(scope["path"])) is not None:
            state = scope["app"].state
            proxy: SessionProxy | None = getattr(state, "proxy", None)
            headers = dict(scope["headers"])
            if proxy is not None and hit[0] in proxy.sessions and _FORWARDED not in headers:
                await self._answer(proxy, state.auth, headers, *hit, receive, send)
                return
        await self.app(scope, receive, send)

    async def _answer(
        self,
        proxy: SessionProxy,
        auth: AuthPolicy,
        headers: dict[bytes, bytes],
        session_id: str,
        call: ModelCall,
        receive: Receive,
        send: Send,
    ) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the agent went away before sending its body
        try:
            if auth.token and auth.protect_agent_routes:
                header = headers.get(b"authorization")
                verify_bearer(header.decode("latin-1") if header is not None else None, auth.token)
            answer = await call.answer(proxy, session_id, decode_body(body, call.request))
        except HTTPError as exc:
            extra = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
            await _send(send, exc.status, msgspec.json.encode(answer_error(exc)), extra)
            return
        await _send(send, 200, answer)


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers: list[Any] = [_JSON, (b"content-length", str(len(body)).encode()), *(extra or ())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

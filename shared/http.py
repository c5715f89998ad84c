"""HTTP boundary helpers shared by every service: typed request bodies and error mapping.

Request bodies are decoded with msgspec straight into Structs (no ``await request.json()`` dicts),
so a bad request gets a 400 whose message and ``param`` name the offending field. Every service
installs `install_error_handlers` once; errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

Bearer-token checks are FastAPI dependencies here too: `require_control_token` on every control
route, `require_agent_token` on agent-facing routes; both read the `shared.auth.AuthPolicy` on
``app.state.auth``. Missing or malformed header: 401 with ``WWW-Authenticate: Bearer``; wrong
token: 403; the comparison is `hmac.compare_digest` (constant time) and no message echoes a token.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from shared.auth import AuthPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")

_AT = re.compile(r"^(.*) - at `\$((?:[.\[][^`]*)?)`$")
_NAMED_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]*)`")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="streamrl"'}


class HTTPError(Exception):
    """An error with an HTTP status, raised anywhere below a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if 400 <= status < 500 else "server_error")
        self.headers = headers  # e.g. WWW-Authenticate on a 401


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param)


def decode_body(body: bytes, cls: type[T]) -> T:
    """Decode a JSON body into ``cls``; a 400 naming the field on failure."""
    if not body:
        raise bad_request("request body is empty; a JSON object is required")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as exc:
        raise bad_request(*_field_error(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None


def _field_error(msg: str) -> tuple[str, str | None]:
    """msgspec's validation message and the field it is about (dotted from the body's root). A
    missing or unknown field is named by the message itself, so it becomes the param too."""
    m = _AT.match(msg)
    what, at = (m.group(1), m.group(2).lstrip(".")) if m else (msg, "")
    named = _NAMED_FIELD.match(what)
    param = ".".join(p for p in (at, named.group(1) if named else "") if p) or None
    return (f"{what} at field '{at}'" if at else what), param


async def read_body(request: Request, cls: type[T]) -> T:
    return decode_body(await request.body(), cls)


class MsgspecJSON(Response):
    """A JSON response rendered by msgspec (Structs, dicts, lists)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def error_payload(status: int, message: str, param: str | None, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def answer_error(exc: HTTPError) -> dict[str, Any]:
    """The error body for ``exc`` (a server error is logged): what every route answers with."""
    if exc.status >= 500:
        log.error("request failed: %s", exc.message)
    return error_payload(exc.status, exc.message, exc.param, exc.type)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return JSONResponse(answer_error(exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = f"{first.get('msg', 'invalid request')} at field '{loc}'" if loc else first.get("msg", "invalid request")
        return JSONResponse(error_payload(400, msg, loc, "invalid_request_error"), status_code=400)


def verify_bearer(header: str | None, expected: str) -> None:
    """Check an Authorization header against ``expected``: 401 if missing or malformed, 403 if wrong."""
    if not header:
        raise HTTPError(
            401,
            "missing Authorization header: send 'Authorization: Bearer <token>'",
            type_="authentication_error",
            headers=_CHALLENGE,
        )
    scheme, _, presented = header.strip().partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        raise HTTPError(
            401,
            "malformed Authorization header: expected 'Bearer <token>'",
            type_="authentication_error",
            headers=_CHALLENGE,
        )
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise HTTPError(403, "the bearer token is not valid for this service", type_="permission_error")


def _policy(request: Request) -> AuthPolicy:
    policy = getattr(request.app.state, "auth", None)
    return policy if policy is not None else AuthPolicy(None)


async def require_control_token(request: Request) -> None:
    """FastAPI dependency of every control route."""
    policy = _policy(request)
    if policy.token:
        verify_bearer(request.headers.get("authorization"), policy.token)


async def require_agent_token(request: Request) -> None:
    """FastAPI dependency of the agent-facing routes (checked only with auth.protect_agent_routes)."""
    policy = _policy(request)
    if policy.token and policy.protect_agent_routes:
        verify_bearer(request.headers.get("authorization"), policy.token)

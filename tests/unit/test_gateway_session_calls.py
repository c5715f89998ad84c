"""The held sessions' model calls, answered in front of the framework (`SessionCalls`): the same
status and body as the framework's routes for every outcome, at every session prefix.

A real aiohttp server stands in for the generator; the gateway app is the service's own session
routes (`mount_session_routes`) over a real `SessionProxy`, called through httpx's ASGI transport.
Each request goes once as an agent sends it (answered by `SessionCalls`) and once marked as
forwarded (which `SessionCalls` leaves to the routes), on two sessions with the same history.
"""

from __future__ import annotations

import time

import aiohttp
import httpx
import msgspec
import pytest
from aiohttp import web
from fastapi import FastAPI

from services.gym_gateway import session_calls
from services.gym_gateway.app import mount_session_routes
from services.gym_gateway.forwarding import FORWARDED_HEADER, SessionForwarder
from services.gym_gateway.proxy import GeneratorPool, SessionProxy
from services.gym_gateway.session_routes import SESSION_PREFIXES
from shared import keys as K
from shared.auth import AuthPolicy
from shared.http import install_error_handlers
from shared.openai_api import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ResponseMessage,
    Usage,
)
from shared.protocol import Heartbeat, SamplingParams
from shared.streams import connect

pytestmark = pytest.mark.unit
TOKEN = "calls-token-0123456789"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/sessions/s1/v1/chat/completions", ("s1", "/v1/chat/completions")),
        ("/sessions/s1/v1/completions", ("s1", "/v1/completions")),
        ("/ng-rollout/r-7/v1/responses", ("r-7", "/v1/responses")),
        ("/ng-rollout/r-7/training-token-capture/v1/chat/completions", ("r-7", "/v1/chat/completions")),
        ("/sessions/s1/training-token-capture/v1/chat/completions", None),  # only NeMo-Gym's prefix has it
        ("/sessions/s1/v1/models", None),
        ("/sessions/s1/tokenize", None),
        ("/sessions//v1/chat/completions", None),
        ("/sessions/s1", None),
        ("/v1/responses", None),
        ("/sessions/s1/v1/chat/completions/x", None),
    ],
)
def test_match_finds_the_model_calls_under_every_prefix(path, expected):
    hit = session_calls.match(path)
    got = None if hit is None else (hit[0], next(p for p, c in session_calls.MODEL_CALLS.items() if c is hit[1]))
    assert got == expected


async def _stand_in_generator(app: web.Application) -> None:
    def _answer(request_body: bytes, chat: bool) -> bytes:
        req = msgspec.json.decode(request_body)
        prompt = (req.get("required_prefix_token_ids") or [1, 2, 3]) + [7, 8]
        gen, lps = [40, 41], [-0.5, -0.25]
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=2, total_tokens=len(prompt) + 2)
        if chat:
            msg = ResponseMessage(
                content="four", prompt_token_ids=prompt, generation_token_ids=gen, generation_log_probs=lps
            )
            choice = ChatChoice(index=0, message=msg, finish_reason="stop", token_ids=gen)
            out: object = ChatCompletionResponse(
                id="c", created=int(time.time()), model="m", choices=[choice], usage=usage,
                prompt_token_ids=prompt, weight_version=0, weight_version_end=0,
            )  # fmt: skip
        else:
            choice2 = CompletionChoice(
                index=0, text="four", finish_reason="stop", generation_token_ids=gen, generation_log_probs=lps
            )
            out = CompletionResponse(
                id="c", created=int(time.time()), model="m", choices=[choice2], usage=usage,
                prompt_token_ids=prompt, weight_version=0, weight_version_end=0,
            )  # fmt: skip
        return msgspec.json.encode(out)

    async def chat(request: web.Request) -> web.Response:
        return web.Response(body=_answer(await request.read(), True), content_type="application/json")

    async def completions(request: web.Request) -> web.Response:
        return web.Response(body=_answer(await request.read(), False), content_type="application/json")

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)


@pytest.fixture
async def gateway():
    upstream = web.Application()
    await _stand_in_generator(upstream)
    runner = web.AppRunner(upstream)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    class OnePool(GeneratorPool):
        async def _refresh(self, stale_before: float) -> None:
            hb = Heartbeat(worker_id="g0", kind="generator", url=url, state="ready", weight_version=0)
            self._ready, self._at = [hb], float("inf")

    app = FastAPI()
    app.state.auth, app.state.forwarder = AuthPolicy(TOKEN, protect_agent_routes=True), SessionForwarder("gw-0")
    install_error_handlers(app)
    mount_session_routes(app)
    async with aiohttp.ClientSession() as http:
        app.state.proxy = SessionProxy(
            OnePool(connect("redis://127.0.0.1:1/0"), K.RunKeys("t")), http, request_timeout_s=30
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield app, client
    await runner.cleanup()


CALLS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2?"}]}),
    ("/v1/completions", {"prompt": [5, 6, 7]}),
    ("/v1/responses", {"input": "2+2?"}),
]
BAD = [
    ("/v1/chat/completions", {"messages": "hello"}),  # 400 naming messages
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),  # 400 stream
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),  # 400 n
    ("/v1/completions", {}),  # 400 naming prompt
    ("/v1/responses", {"input": 3}),  # 400 naming input
]
AUTH = {"authorization": f"Bearer {TOKEN}"}


async def _both(client: httpx.AsyncClient, app: FastAPI, prefix: str, path: str, body, headers) -> tuple:
    """(answer to the agent's call, answer of the routes) for one call on two twin sessions."""
    sampling = SamplingParams(max_tokens=8)
    for sid in ("fast", "routes"):
        app.state.proxy.close(sid)
        await app.state.proxy.open(sid, "train", sampling)
    fast = await client.post(prefix.format(session_id="fast") + path, json=body, headers=headers)
    routed = await client.post(
        prefix.format(session_id="routes") + path, json=body, headers={**headers, FORWARDED_HEADER: "1"}
    )
    return fast, routed


def _same(fast: httpx.Response, routed: httpx.Response) -> None:
    assert fast.status_code == routed.status_code, (fast.text, routed.text)
    assert fast.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert _scrub(fast.json()) == _scrub(routed.json())


def _scrub(value):
    """``value`` without what differs per answer: ids and creation times."""
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in ("id", "created", "created_at")}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


async def test_held_sessions_get_what_the_routes_answer(gateway, monkeypatch):
    app, client = gateway
    served = []
    answer = session_calls.SessionCalls._answer

    async def counting(self, *args):
        served.append(args[3])  # the session id
        await answer(self, *args)

    monkeypatch.setattr(session_calls.SessionCalls, "_answer", counting)
    for prefix in SESSION_PREFIXES:
        for path, body in CALLS + BAD:
            fast, routed = await _both(client, app, prefix, path, body, AUTH)
            _same(fast, routed)
            ok = (path, body) in CALLS
            assert fast.status_code == (200 if ok else 400)
            for sid in ("fast", "routes"):  # recorded alike: one turn for an answer, none for a 400
                s = app.state.proxy.session(sid)
                assert [t.generated().tolist() for t in s.turns] == ([[40, 41]] if ok else [])
    assert served == ["fast"] * (len(SESSION_PREFIXES) * len(CALLS + BAD))


async def test_the_agent_token_is_checked_as_by_the_routes(gateway):
    app, client = gateway
    path, body = CALLS[0]
    for headers, status in (({}, 401), ({"authorization": "Bearer wrong"}, 403), ({"authorization": "Basic x"}, 401)):
        fast, routed = await _both(client, app, SESSION_PREFIXES[0], path, body, headers)
        _same(fast, routed)
        assert fast.status_code == status
        assert fast.headers.get("www-authenticate") == routed.headers.get("www-authenticate")
    assert app.state.proxy.session("fast").calls == 0


async def test_calls_the_worker_does_not_hold_go_to_the_routes(gateway):
    app, client = gateway

    class NoPeers(SessionForwarder):
        async def _candidates(self, session_id, proxy):
            return []  # a one-worker run: no other gateway holds it

    app.state.forwarder = NoPeers("gw-0")
    r = await client.post("/sessions/nobody/v1/chat/completions", json=CALLS[0][1], headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"

"""The in-process model client (`SessionClient`) against the HTTP one (`ChatClient` through the
gateway's session routes), on one real gateway in front of a scripted generator: the same answer
and the same recorded turns for the same conversation, and the same error class for every way a
call can fail (a 4xx is `ModelRequestError`, a 5xx or an unreachable generator `TransportError`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from services.gym_gateway.envs.base import ChatClient, ModelClient, ModelRequestError, TransportError
from services.gym_gateway.session_client import SessionClient
from shared.openai_api import ChatMessage, ResponseMessage
from shared.protocol import SamplingParams
from tests.support.fakes.generator import Refuse, call, say

pytestmark = pytest.mark.integration

SAMPLING = SamplingParams(max_tokens=8)


def chatty(messages: list[ChatMessage]) -> ResponseMessage:
    return call("look", {}) if messages[-1].role == "user" else say("go")


def refusing(messages: list[ChatMessage]) -> ResponseMessage:
    raise Refuse(400, "the prompt is longer than the context")


def failing(messages: list[ChatMessage]) -> ResponseMessage:
    raise Refuse(500, "engine died")


def draining(messages: list[ChatMessage]) -> ResponseMessage:
    raise Refuse(503, "draining")


POLICIES = {"chat": chatty, "refuse": refusing, "fail": failing, "gone": draining}
Opener = Callable[[str], Awaitable[tuple[ModelClient, ModelClient]]]


@pytest.fixture
async def clients(scripted_gateway):
    """``open(policy)``: a session for each client, both played by ``policy``; (in-process, HTTP)."""
    async with scripted_gateway(POLICIES, gym_gateway={"max_failovers": 0}) as st, aiohttp.ClientSession() as http:
        proxy = st.gateway.state.proxy
        count = iter(range(1000))

        async def open_pair(policy: str) -> tuple[ModelClient, ModelClient]:
            pair = []
            for kind in ("inproc", "http"):
                sid = f"{policy}-{kind}.{next(count)}"
                await proxy.open(sid, "train", SAMPLING)
                url = f"{st.url}/sessions/{sid}/v1"
                if kind == "inproc":
                    pair.append(SessionClient(proxy, sid, base_url=url, http=http, timeout_s=30, sampling=SAMPLING))
                else:
                    pair.append(ChatClient(url, http, timeout_s=30, sampling=SAMPLING, session_id=sid))
            return pair[0], pair[1]

        yield open_pair, proxy


async def test_both_clients_get_the_same_answers_and_record_the_same_turns(clients):
    open_pair, proxy = clients
    inproc, http = await open_pair("chat")
    for client in (inproc, http):
        msgs = [{"role": "user", "content": "look first"}]
        first = (await client.chat(msgs, tools=[{"type": "function", "function": {"name": "look"}}])).choices[0]
        assert first.message.tool_calls[0].function.name == "look"
        msgs += [
            {"role": "assistant", "content": "", "tool_calls": [first.message.tool_calls[0]]},
            {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "red"},
        ]
        second = (await client.chat(msgs)).choices[0]
        assert second.message.content == "go"
    a, b = proxy.sessions[inproc.session_id], proxy.sessions[http.session_id]
    assert a.calls == b.calls == 2 and a.prefix_breaks == b.prefix_breaks == 0
    assert [(list(t.prompt()), list(t.generated()), t.context_len) for t in a.turns] == [
        (list(t.prompt()), list(t.generated()), t.context_len) for t in b.turns
    ]
    assert a.turns[1].context_len == 2  # one prompt and one generated token before


@pytest.mark.parametrize(
    ("policy", "messages", "params", "error", "words"),
    [
        ("chat", "hello", {}, ModelRequestError, "messages"),  # the route's body validation
        ("chat", [{"role": "user", "content": "x"}], {"n": 2}, ModelRequestError, "n must be 1"),
        ("chat", [{"role": "user", "content": "x"}], {"stream": True}, ModelRequestError, "streaming"),
        ("refuse", [{"role": "user", "content": "x"}], {}, ModelRequestError, "longer than the context"),
        ("fail", [{"role": "user", "content": "x"}], {}, TransportError, "engine died"),
        ("gone", [{"role": "user", "content": "x"}], {}, TransportError, "unavailable"),
    ],
)
async def test_both_clients_fail_the_same_way(clients, policy, messages, params, error, words):
    open_pair, _ = clients
    for client in await open_pair(policy):
        with pytest.raises(error, match=words):
            await client.chat(messages, **params)


async def test_a_closed_session_is_refused_by_both(clients):
    open_pair, proxy = clients
    for client in await open_pair("chat"):
        proxy.close(client.session_id)
        with pytest.raises(ModelRequestError, match="unknown or finished session"):
            await client.chat([{"role": "user", "content": "x"}])

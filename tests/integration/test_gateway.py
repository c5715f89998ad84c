"""Gym gateway against real parts: a generator (transformers engine) and the gateway served by
uvicorn on loopback ports, a real Valkey, tasks and trajectories through the streams.

Covers the session proxy's token-exact recording across turns, task -> trajectory -> ack, the
launch gate, failure classification, dead-lettering of bad task entries, and HTTP errors.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shared import keys as K
from shared.protocol import SamplingParams
from tests.support.gateway import collect, gateway_task

pytestmark = pytest.mark.integration


@pytest.fixture
async def stack(gateway_stack):
    """Valkey + generator (weights v0 confirmed) + gateway; yields (gateway app, streams, gateway url)."""
    async with gateway_stack() as st:
        yield st.gateway, st.streams, st.url


_task, _collect = gateway_task, collect


async def test_tasks_become_trajectories_and_are_acked_after_publishing(stack):
    cfg, streams, _ = stack
    await streams.publish_many(streams.keys.tasks, [_task(i) for i in range(3)])
    trajs = await _collect(streams, 3)
    assert sorted(t.task_id for t in trajs) == ["g0/0", "g1/0", "g2/0"]
    for t in trajs:
        assert t.status == "ok" and t.launch_version == 0 and t.turns
        assert t.turns[0].context_len == 0 and len(t.turns[0].generated()) > 0
        assert len(t.turns[0].generated()) == len(t.turns[0].logprobs())
    await asyncio.sleep(0.2)
    assert (await streams.redis.xpending(streams.keys.tasks, K.GATEWAYS_GROUP))["pending"] == 0


async def test_session_proxy_records_token_exact_multi_turn_history(stack):
    gateway, _, gw_url = stack
    from services.gym_gateway.envs.crossing import LOOK_TOOL

    # open a session the way the worker does, then drive it over HTTP like a black-box agent
    session = await gateway.state.proxy.open("agent-1", "train", SamplingParams(max_tokens=12))
    msgs = [{"role": "user", "content": "Look at the light, then decide."}]
    async with httpx.AsyncClient(base_url=f"{gw_url}/sessions/agent-1/v1", timeout=60) as http:
        r1 = (await http.post("/chat/completions", json={"messages": msgs, "tools": [LOOK_TOOL]})).json()
        text1 = r1["choices"][0]["message"].get("content") or ""
        # the agent sends back an edited text of the model's turn: the tokens must still be the model's
        msgs += [{"role": "assistant", "content": text1 + "  edited"}, {"role": "user", "content": "The light is red."}]
        r2 = (await http.post("/chat/completions", json={"messages": msgs, "tools": [LOOK_TOOL]})).json()
    t1, t2 = session.turns
    seen = list(t1.prompt()) + list(t1.generated())
    assert r2["prompt_token_ids"][: len(seen) - 1] == seen[:-1] or r2["prompt_token_ids"][: len(seen)] == seen
    assert t2.context_len == len(seen) and session.prefix_breaks == 0
    assert list(t2.prompt()) == r2["prompt_token_ids"][len(seen) :]
    assert t1.weight_version == t2.weight_version == 0


async def test_prefix_break_is_detected_when_history_is_rewritten(stack):
    gateway, _, gw_url = stack
    session = await gateway.state.proxy.open("agent-2", "train", SamplingParams(max_tokens=8))
    async with httpx.AsyncClient(base_url=f"{gw_url}/sessions/agent-2/v1", timeout=60) as http:
        await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "first question"}]})
        # a new conversation in the same session: no assistant turn replayed, prompt diverges
        await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "another topic"}]})
    assert session.prefix_breaks == 1
    assert session.turns[1].context_len < len(session.turns[0].prompt())


async def test_launch_gate_holds_new_rollouts_until_reopened(stack):
    _, streams, _ = stack
    await streams.redis.hset(streams.keys.pause, "user", "1")
    await asyncio.sleep(0.5)  # the worker sees the gate before the task arrives
    await streams.publish(streams.keys.tasks, _task(7))
    assert await _collect(streams, 1, timeout_s=2.0) == []
    await streams.redis.hdel(streams.keys.pause, "user")
    assert [t.task_id for t in await _collect(streams, 1)] == ["g7/0"]


async def test_failures_are_classified_and_bad_entries_dead_lettered(stack):
    _, streams, _ = stack
    await streams.redis.xadd(streams.keys.tasks, {K.ENTRY_FIELD: b"not a task"})
    await streams.publish(streams.keys.tasks, _task(8, env="no_such_env"))
    await streams.publish(streams.keys.tasks, _task(9, instance={"light": "purple"}))
    trajs = {t.task_id: t for t in await _collect(streams, 2)}
    assert trajs["g8/0"].status == "failed" and trajs["g8/0"].fallback_reason.startswith("unknown_env")
    assert trajs["g9/0"].status == "failed" and trajs["g9/0"].fallback_reason.startswith("env_error")
    assert await streams.redis.xlen(streams.keys.deadletter) == 1


async def test_proxy_http_errors_name_the_problem(stack):
    _, _, gw_url = stack
    async with httpx.AsyncClient(base_url=gw_url, timeout=30) as http:
        r = await http.post("/sessions/nope/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
        r = await http.post("/sessions/nope/v1/chat/completions", json={"messages": "hello"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert (await http.get("/ready")).status_code == 200
        assert "streamrl_gateway_model_calls_total" in (await http.get("/metrics")).text


async def test_streaming_is_refused_on_every_session_path(stack):
    """One check in the session proxy covers chat, completions and Responses at every prefix."""
    from services.gym_gateway.session_routes import SESSION_PREFIXES

    gateway, _, gw_url = stack
    session = await gateway.state.proxy.open("stream-1", "train", SamplingParams(max_tokens=4))
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "stream": True},
        "/v1/completions": {"prompt": [5, 6, 7], "stream": True},
        "/v1/responses": {"input": "x", "stream": True},
    }
    refused = []
    async with httpx.AsyncClient(base_url=gw_url, timeout=30) as http:
        for prefix in SESSION_PREFIXES:
            for path, body in bodies.items():
                r = await http.post(prefix.format(session_id="stream-1") + path, json=body)
                assert r.status_code == 400, (prefix, path, r.text)
                refused.append(r.json()["error"]["param"])
    assert refused == ["stream"] * 9 and session.calls == 0

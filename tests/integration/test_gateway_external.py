"""The session API for external agents (`services.gym_gateway.external`), against a real gateway
(worker, session proxy, routes, served by uvicorn) in front of a scripted generator, on Valkey.

An agent claims a task of environment ``external`` with POST /sessions, talks to the session's URL
with the ``openai`` client and completes it with its reward: the trajectory is published once and
holds the tokens the agent was answered with. The routes need the API token when one is set; bad
input is a 4xx naming the field; a second or late complete is a 409; a session not completed by its
deadline fails per env.failure_policy; the launch gate and a drain hold the claims back; a waiting
task is not reclaimed from the live worker that holds it; any worker of a run hands out and takes
back the tasks of another.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from shared import keys as K
from shared.protocol import SamplingParams, Task
from shared.streams import StreamClient
from streamrl.redis_server import free_port
from tests.support.fakes.generator import say
from tests.support.gateway import collect
from tests.support.messages import make_task

pytestmark = pytest.mark.integration

TOKEN = "ext-3b9f01c2d7e84a65"
POLICIES = {"agent": lambda messages: say(f"answer {len(messages)}")}


def external_task(i: int, *, deadline_s: float = 30.0) -> Task:
    """A task of environment ``external``; its group id starts with the scripted policy's name."""
    return make_task(
        f"agent-{i}",
        prompt_index=i,
        env="external",
        instance={"question": f"what is {i} + {i}?"},
        sampling=SamplingParams(temperature=0.7, max_tokens=12),
        deadline_s=deadline_s,
    )


async def until(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def waiting(stack, n: int = 1):
    worker = stack.gateway.state.worker
    return until(lambda: worker.external.waiting == n, f"{n} external task(s) waiting")


async def chat_twice(base_url: str) -> tuple:
    """Two turns through the session with the official client, the model's turn replayed as text."""
    llm = openai.AsyncOpenAI(base_url=base_url, api_key="any", max_retries=0)
    messages = [{"role": "user", "content": "what is 1 + 1?"}]
    first = await llm.chat.completions.create(model="policy", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "are you sure?"},
    ]
    second = await llm.chat.completions.create(model="policy", messages=messages)
    await llm.close()
    return first, second


def assert_token_exact(traj, first, second) -> None:
    """The trajectory's turns are the tokens the agent was answered with, the second continuing the first."""
    t1, t2 = traj.turns
    p1, g1 = first.model_extra["prompt_token_ids"], first.choices[0].message.model_extra["generation_token_ids"]
    assert list(t1.prompt()) == p1 and t1.context_len == 0 and list(t1.generated()) == g1
    assert list(t1.logprobs()) == first.choices[0].message.model_extra["generation_log_probs"]
    p2 = second.model_extra["prompt_token_ids"]
    assert t2.context_len == len(p1) + len(g1) and p2[: t2.context_len] == p1 + g1
    assert list(t2.prompt()) == p2[t2.context_len :]
    assert list(t2.generated()) == second.choices[0].message.model_extra["generation_token_ids"]


async def test_an_agent_claims_a_task_chats_and_completes_it_once(scripted_gateway):
    async with scripted_gateway(POLICIES) as st, httpx.AsyncClient(base_url=st.url, timeout=30) as http:
        assert (await http.post("/sessions")).status_code == 204  # nothing waits
        await st.streams.publish(st.streams.keys.tasks, external_task(1))
        await waiting(st)
        assert "streamrl_gateway_external_waiting 1.0" in (await http.get("/metrics")).text
        claimed = await http.post("/sessions")
        assert claimed.status_code == 200, claimed.text
        grant = claimed.json()
        sid = grant["session_id"]
        assert grant["base_url"] == f"{st.url}/sessions/{sid}/v1"
        assert grant["complete_url"] == f"{st.url}/sessions/{sid}/complete"
        assert (grant["task_id"], grant["kind"]) == ("agent-1/0", "train")
        assert grant["instance"] == {"question": "what is 1 + 1?"}
        assert grant["sampling"]["temperature"] == 0.7 and grant["sampling"]["max_tokens"] == 12
        assert grant["max_turns"] == st.cfg.env.max_turns
        assert 29 < grant["deadline_s"] <= 30 and time.time() < grant["deadline_at"] <= time.time() + 30
        assert (await http.post("/sessions")).status_code == 204  # claimed: not handed out twice
        first, second = await chat_twice(grant["base_url"])
        done = await http.post(
            grant["complete_url"], json={"reward": 0.75, "mask_sample": True, "metrics": {"agent_steps": 2}}
        )
        assert done.status_code == 200, done.text
        assert done.json() == {"session_id": sid, "task_id": "agent-1/0", "model_calls": 2, "prefix_breaks": 0}
        again = await http.post(grant["complete_url"], json={"reward": 1.0})
        assert again.status_code == 409 and again.json()["error"]["param"] == "session_id"
        (traj,) = await collect(st.streams, 1)
        late = await http.post(grant["complete_url"], json={"reward": 1.0})
        assert late.status_code == 409 and "has ended (completed)" in late.json()["error"]["message"]
        assert await collect(st.streams, 1, timeout_s=1.0) == []  # published once
        assert (await st.streams.redis.xpending(st.streams.keys.tasks, K.GATEWAYS_GROUP))["pending"] == 0
    assert traj.task_id == "agent-1/0" and traj.env == "external" and traj.reward == 0.75
    assert traj.status == "env_flagged" and traj.mask_sample is True and traj.launch_version == 0
    assert traj.metrics["agent_steps"] == 2.0 and traj.metrics["model_calls"] == 2.0
    assert_token_exact(traj, first, second)


async def test_the_session_api_needs_the_token(scripted_gateway, monkeypatch):
    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    async with scripted_gateway(POLICIES) as st, httpx.AsyncClient(base_url=st.url, timeout=30) as http:
        for path, body in (("/sessions", None), ("/sessions/some-session/complete", {"reward": 1.0})):
            refused = await http.post(path, json=body)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer"), path
            wrong = await http.post(path, json=body, headers={"Authorization": "Bearer not-the-token"})
            assert wrong.status_code == 403, path
        assert (await http.post("/sessions", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 204
        unknown = await http.post(
            "/sessions/some-session/complete", json={"reward": 1.0}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "session_id"


async def test_bad_completions_are_refused_naming_the_field_and_the_session_goes_on(scripted_gateway):
    async with scripted_gateway(POLICIES) as st, httpx.AsyncClient(base_url=st.url, timeout=30) as http:
        await st.streams.publish(st.streams.keys.tasks, external_task(2))
        await waiting(st)
        url = (await http.post("/sessions")).json()["complete_url"]
        bad = {
            "reward": {},
            "mask_sample": {"reward": 1.0, "mask_sample": "yes"},
            "metrics[...]": {"reward": 1.0, "metrics": {"steps": "two"}},
            "score": {"reward": 1.0, "score": 3},
        }
        for param, body in bad.items():
            r = await http.post(url, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
        assert (await http.post(url, json={"reward": "high"})).json()["error"]["param"] == "reward"
        assert (await http.post(url, content=b'{"reward": 1e999}')).json()["error"]["param"] == "reward"
        assert (await http.post(url, content=b"reward=1")).status_code == 400
        assert (await http.post(url, json={"reward": 1.0})).status_code == 200
        (traj,) = await collect(st.streams, 1)
    assert traj.status == "ok" and traj.reward == 1.0


async def test_a_session_not_completed_by_its_deadline_fails_fast(scripted_gateway):
    async with scripted_gateway(POLICIES) as st, httpx.AsyncClient(base_url=st.url, timeout=30) as http:
        await st.streams.publish(st.streams.keys.tasks, external_task(3, deadline_s=1.0))
        await waiting(st)
        await asyncio.sleep(1.5)  # waiting for an agent does not count against the deadline
        grant = (await http.post("/sessions")).json()
        assert grant["deadline_s"] == 1.0
        (traj,) = await collect(st.streams, 1, timeout_s=10)
        late = await http.post(grant["complete_url"], json={"reward": 1.0})
    assert traj.status == "failed" and traj.failure_kind == "infra" and traj.turns == []
    assert traj.fallback_reason.startswith("timeout") and traj.metrics["attempts"] == 1.0
    assert late.status_code == 409 and "timeout" in late.json()["error"]["message"]


async def test_with_the_retry_policy_an_expired_session_is_offered_again(scripted_gateway):
    async with (
        scripted_gateway(POLICIES, env={"failure_policy": "retry", "max_rollout_retries": 1}) as st,
        httpx.AsyncClient(base_url=st.url, timeout=30) as http,
    ):
        await st.streams.publish(st.streams.keys.tasks, external_task(4, deadline_s=1.0))
        await waiting(st)
        expired = (await http.post("/sessions")).json()
        await waiting(st)  # the deadline passed: the task waits for an agent again, in a fresh session
        grant = (await http.post("/sessions")).json()
        assert grant["task_id"] == expired["task_id"] and grant["session_id"] != expired["session_id"]
        assert (await http.post(expired["complete_url"], json={"reward": 1.0})).status_code == 409
        await chat_twice(grant["base_url"])
        assert (await http.post(grant["complete_url"], json={"reward": 1.0})).status_code == 200
        (traj,) = await collect(st.streams, 1)
    assert traj.status == "ok" and traj.metrics["attempts"] == 2.0 and len(traj.turns) == 2
    assert st.gateway.state.worker.retried == {"timeout": 1}


async def test_no_task_is_handed_out_while_the_launch_gate_is_closed(scripted_gateway):
    async with scripted_gateway(POLICIES) as st, httpx.AsyncClient(base_url=st.url, timeout=30) as http:
        await st.streams.publish(st.streams.keys.tasks, external_task(5))
        await waiting(st)
        await st.streams.redis.hset(st.streams.keys.pause, "user", "1")
        assert (await http.post("/sessions")).status_code == 204
        await st.streams.redis.hdel(st.streams.keys.pause, "user")
        claimed = await http.post("/sessions")
        assert claimed.status_code == 200
        assert (await http.post(claimed.json()["complete_url"], json={"reward": 0.0})).status_code == 200


async def test_a_drain_releases_the_tasks_no_agent_claimed_at_once(scripted_gateway):
    async with scripted_gateway(POLICIES) as st, httpx.AsyncClient(base_url=st.url, timeout=30) as http:
        streams, worker = st.streams, st.gateway.state.worker
        await streams.publish(streams.keys.tasks, external_task(6))
        await waiting(st)
        # Released at once: the drain returns long before its timeout_s, which is what waiting for
        # an agent would take (the bound is the requirement, with room for a loaded machine).
        await asyncio.wait_for(worker.drain(timeout_s=600), 60)
        assert worker.released == 1
        assert (await http.post("/sessions")).status_code == 204
        other = StreamClient(streams.redis, streams.keys, "gw-other")
        got = await other.read_group(streams.keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=500)
        assert [d.msg.task_id for d in got] == ["agent-6/0"] and got[0].msg.attempt >= 1
        assert await collect(streams, 1, timeout_s=0.5) == []


# gym_gateway.reclaim_idle_s of the test below: the worker touches what it holds every quarter of
# it, so only a stall of the loop longer than three quarters of it (far more than a loaded machine
# causes) could let an entry look abandoned.
RECLAIM_IDLE_S = 6.0


async def test_a_task_waiting_for_an_agent_is_not_reclaimed_from_its_live_worker(scripted_gateway):
    async with (
        scripted_gateway(POLICIES, gym_gateway={"reclaim_idle_s": RECLAIM_IDLE_S, "max_concurrent_rollouts": 1}) as st,
        httpx.AsyncClient(base_url=st.url, timeout=30) as http,
    ):
        streams = st.streams
        await streams.publish(streams.keys.tasks, external_task(7))
        await waiting(st)
        # Held half as long again as the reclaim window: untouched, its entry would be idle that long.
        await asyncio.sleep(1.5 * RECLAIM_IDLE_S)
        other = StreamClient(streams.redis, streams.keys, "gw-other")
        idle_ms = int(RECLAIM_IDLE_S * 1000)
        assert await other.reclaim(streams.keys.tasks, K.GATEWAYS_GROUP, Task, min_idle_ms=idle_ms) == []
        url = (await http.post("/sessions")).json()["complete_url"]
        assert (await http.post(url, json={"reward": 1.0})).status_code == 200
        (traj,) = await collect(streams, 1)
    assert traj.status == "ok" and traj.gateway_id == "gw-0"


async def test_any_worker_hands_out_and_takes_back_the_tasks_of_another(scripted_gateway, serve_app, monkeypatch):
    """Claims and completes sent to a worker holding no task reach the one that does, token and all."""
    from services.gym_gateway.app import build_app

    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with scripted_gateway(POLICIES) as st:
        await st.streams.publish(st.streams.keys.tasks, external_task(8))
        await waiting(st)  # held by gw-0
        port = free_port()
        async with (
            serve_app(build_app(st.cfg, worker_id="gw-1", port=port), port) as other_url,
            httpx.AsyncClient(base_url=other_url, timeout=30, headers=auth) as http,
        ):
            claimed = await http.post("/sessions")
            assert claimed.status_code == 200, claimed.text
            grant = claimed.json()
            assert grant["base_url"].startswith(f"{st.url}/sessions/")  # the session lives on gw-0
            await chat_twice(grant["base_url"])
            complete = f"/sessions/{grant['session_id']}/complete"
            done = await http.post(complete, json={"reward": 1.0})
            assert done.status_code == 200, done.text
            assert done.json()["model_calls"] == 2
            assert (await http.post(complete, json={"reward": 0.0})).status_code == 409
            (traj,) = await collect(st.streams, 1)
            assert await collect(st.streams, 1, timeout_s=0.5) == []
    assert traj.gateway_id == "gw-0" and traj.reward == 1.0 and len(traj.turns) == 2

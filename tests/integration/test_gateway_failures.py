"""The gateway's failure handling against real parts (transformers-engine generators and the gateway
on loopback ports, a real Valkey): session failover off a dead generator, infra vs policy failures,
the retry policy, zero-token placeholders, release of unfinished tasks on drain, and plain
completions through the session proxy."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from services.gym_gateway.envs.base import ChatClient, Outcome, SandboxError
from shared import keys as K
from shared.protocol import SamplingParams, Task
from tests.support.gateway import collect, gateway_task

pytestmark = pytest.mark.integration


class FlakyEnv:
    """Fails with a sandbox error on the first ``instance["fail_times"]`` attempts of each task,
    then makes one model call; or sleeps ``instance["sleep_s"]`` first; or sends a prompt longer
    than the context after one good call (``instance["overflow"]``)."""

    name = "flaky"

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [{"key": str(i)} for i in range(n)]

    async def aclose(self) -> None:
        pass

    async def rollout(self, instance: dict[str, Any], llm: ChatClient, *, max_turns: int) -> Outcome:
        key = instance["key"]
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.attempts[key] <= instance.get("fail_times", 0):
            raise SandboxError(f"container for {key} did not start")
        await asyncio.sleep(instance.get("sleep_s", 0))
        msgs = [{"role": "user", "content": "say something"}]
        r = await llm.chat(msgs)
        if instance.get("overflow"):
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": "word " * 40_000},
            ]
            await llm.chat(msgs)
        return Outcome(reward=1.0)


async def test_a_session_fails_over_when_its_generator_dies(gateway_stack):
    async with gateway_stack(num_generators=2) as st:
        proxy = st.gateway.state.proxy
        s = await proxy.open("fo-1", "train", SamplingParams(max_tokens=6), env="agent-x")
        first = s.generator_id
        async with httpx.AsyncClient(base_url=f"{st.url}/sessions/fo-1/v1", timeout=60) as http:
            msgs = [{"role": "user", "content": "hello"}]
            r1 = (await http.post("/chat/completions", json={"messages": msgs})).json()
            await st.stop_generator(int(first.split("-")[1]))
            msgs += [
                {"role": "assistant", "content": r1["choices"][0]["message"]["content"] or ""},
                {"role": "user", "content": "again"},
            ]
            r2 = await http.post("/chat/completions", json={"messages": msgs})
            metrics = (await httpx.AsyncClient(base_url=st.url).get("/metrics")).text
        assert r2.status_code == 200, r2.text
        t1, t2 = s.turns
        assert t1.generator_id == first and t2.generator_id != first
        assert s.failovers == 1 and proxy.failovers_total == 1
        # the spliced history survived the move: the second prompt continues the first turn
        assert t2.context_len == len(t1.prompt()) + len(t1.generated()) and s.prefix_breaks == 0
        assert "streamrl_gateway_failovers_total 1.0" in metrics
        # a new session is not routed to the dead generator
        s2 = await proxy.open("fo-2", "train", SamplingParams(max_tokens=6))
        assert s2.generator_id != first


async def test_a_rollout_whose_only_generator_dies_fails_as_infra(gateway_stack, registered_env):
    env = FlakyEnv()
    with registered_env(env):
        async with gateway_stack(num_generators=1, gym_gateway={"max_failovers": 1, "generator_wait_s": 3.0}) as st:
            await st.stop_generator(0)
            await st.streams.publish(st.streams.keys.tasks, gateway_task(1, env="flaky", instance={"key": "a"}))
            (traj,) = await collect(st.streams, 1, timeout_s=90)
    assert traj.status == "failed" and traj.failure_kind == "infra"
    assert traj.fallback_reason.split(":")[0] in ("transport", "no_generator"), traj.fallback_reason
    assert traj.turns == []  # a zero-token placeholder


async def test_retry_policy_reruns_infra_failures_up_to_the_limit(gateway_stack, registered_env):
    env = FlakyEnv()
    with registered_env(env):
        async with gateway_stack(env={"failure_policy": "retry", "max_rollout_retries": 2}) as st:
            await st.streams.publish_many(
                st.streams.keys.tasks,
                [
                    gateway_task(1, env="flaky", instance={"key": "once", "fail_times": 1}),
                    gateway_task(2, env="flaky", instance={"key": "always", "fail_times": 99}),
                ],
            )
            trajs = {t.task_id: t for t in await collect(st.streams, 2)}
            worker = st.gateway.state.worker
            metrics = (await httpx.AsyncClient(base_url=st.url).get("/metrics")).text
    ok, bad = trajs["g1/0"], trajs["g2/0"]
    assert ok.status == "ok" and ok.reward == 1.0 and ok.metrics["attempts"] == 2.0 and ok.turns
    assert bad.status == "failed" and bad.metrics["attempts"] == 3.0 and bad.turns == []
    assert bad.fallback_reason.startswith("sandbox: container for always")
    assert env.attempts == {"once": 2, "always": 3}
    assert worker.retried == {"sandbox": 3} and worker.failed == {"sandbox": 1}
    assert 'streamrl_gateway_rollouts_retried_total{reason="sandbox"} 3.0' in metrics
    assert 'streamrl_gateway_rollouts_failed_total{reason="sandbox"} 1.0' in metrics


async def test_fail_fast_publishes_the_first_infra_failure_without_retrying(gateway_stack, registered_env):
    env = FlakyEnv()
    with registered_env(env):
        async with gateway_stack() as st:
            await st.streams.publish(
                st.streams.keys.tasks, gateway_task(1, env="flaky", instance={"key": "k", "fail_times": 1})
            )
            (traj,) = await collect(st.streams, 1)
    assert traj.status == "failed" and traj.metrics["attempts"] == 1.0 and env.attempts == {"k": 1}


async def test_a_policy_failure_keeps_its_turns_as_a_truncated_zero_reward_rollout(gateway_stack, registered_env):
    env = FlakyEnv()
    with registered_env(env):
        async with gateway_stack(env={"failure_policy": "retry"}) as st:
            await st.streams.publish(
                st.streams.keys.tasks, gateway_task(1, env="flaky", instance={"key": "o", "overflow": True})
            )
            (traj,) = await collect(st.streams, 1)
    assert traj.status == "truncated" and traj.failure_kind == "policy" and traj.reward == 0.0
    assert traj.fallback_reason.startswith("model_refused") and len(traj.turns) == 1
    assert env.attempts == {"o": 1}  # not retried: running it again cannot help


async def test_drain_releases_unfinished_tasks_to_the_group_at_once(gateway_stack, registered_env):
    env = FlakyEnv()
    with registered_env(env):
        async with gateway_stack(gym_gateway={"max_concurrent_rollouts": 2}) as st:
            streams, worker = st.streams, st.gateway.state.worker
            await streams.publish_many(
                streams.keys.tasks,
                [gateway_task(i, env="flaky", instance={"key": str(i), "sleep_s": 30}) for i in range(3)],
            )
            deadline = asyncio.get_running_loop().time() + 60
            while len(worker.active) != 2:
                assert asyncio.get_running_loop().time() < deadline, "the worker did not start two rollouts"
                await asyncio.sleep(0.05)
            await worker.drain(timeout_s=0.5)
            pending = await streams.redis.xpending(streams.keys.tasks, K.GATEWAYS_GROUP)
            # another worker reads all three without waiting for a reclaim
            other = type(streams)(streams.redis, streams.keys, "gw-other")
            got = await other.read_group(streams.keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=500)
    assert worker.released == 2 and pending["pending"] == 0
    assert sorted(d.msg.task_id for d in got) == ["g0/0", "g1/0", "g2/0"]
    released = [d.msg for d in got if d.msg.task_id in ("g0/0", "g1/0")]
    assert all(t.attempt == 1 for t in released)
    assert await collect(streams, 1, timeout_s=0.5) == []  # nothing half-done was published


async def test_completions_through_the_session_are_recorded(gateway_stack, tiny_model_dir):
    async with gateway_stack() as st:
        proxy = st.gateway.state.proxy
        s = await proxy.open("cmp-1", "train", SamplingParams(max_tokens=5))
        async with httpx.AsyncClient(base_url=f"{st.url}/sessions/cmp-1/v1", timeout=60) as http:
            r1 = (await http.post("/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 4})).json()
            gen1 = r1["choices"][0]["generation_token_ids"]
            r2 = (await http.post("/completions", json={"prompt": [5, 6, 7, 8, *gen1, 9]})).json()
            bad = await http.post("/completions", json={"prompt": [5, 6], "n": 2})
    assert r1["prompt_token_ids"] == [5, 6, 7, 8] and 0 < len(gen1) <= 4
    t1, t2 = s.turns
    assert list(t1.generated()) == gen1 and t2.context_len == 4 + len(gen1) and list(t2.prompt()) == [9]
    assert s.prefix_breaks == 0 and r2["choices"][0]["generation_token_ids"] == list(t2.generated())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"

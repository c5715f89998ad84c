"""NaN generation logprobs through a real gateway (worker, session proxy, the crossing environment)
whose generator is scripted: a model call answered with a NaN logprob (JSON ``null``, as the
generator's encoder writes it) ends its rollout as the infrastructure failure
``nan_generation_logprobs``.

What a user relies on:
* the rollout is published as a failed zero-token placeholder naming the reason, so the trainer's
  failure policy decides (a tokens-without-usable-logprobs rollout is never trained);
* an agent in another process gets a 502 for that call, and whatever it makes of it (here it
  swallows the error and reports reward 1) the rollout fails the same way;
* the gateway counts it (``streamrl_gateway_rollouts_failed_total{reason="nan_generation_logprobs"}``)
  and keeps serving: the worker is not killed;
* under ``env.failure_policy: retry`` the rollout runs again, and succeeds once the model answers
  finite logprobs.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.gym_gateway.envs.base import ChatClient, ModelClient, Outcome
from services.gym_gateway.envs.crossing import LOOK_TOOL
from shared.openai_api import ChatMessage, ResponseMessage
from shared.protocol import Trajectory
from tests.support.fakes.generator import Policy, call, say
from tests.support.gateway import counter_by_reason, crossing_task, run_tasks

pytestmark = pytest.mark.integration

NAN = ResponseMessage(content="go", generation_log_probs=[float("nan")])


class SwallowingAgent:
    """An agent in another process, reduced to its model call over the session's HTTP routes: it
    notes the status of a failed call, ignores it and reports reward 1."""

    name = "swallowing_agent"

    def __init__(self) -> None:
        self.errors: list[str] = []

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [{} for _ in range(n)]

    async def aclose(self) -> None:
        pass

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        client = ChatClient(llm.base_url, llm.http, timeout_s=30)
        try:
            await client.chat([{"role": "user", "content": "look"}], tools=[LOOK_TOOL])
        except Exception as exc:
            self.errors.append(str(exc))
        return Outcome(reward=1.0)


def nan_once() -> Policy:
    """NaN logprobs on the first call it plays, a right answer to the green light afterwards."""
    calls: list[int] = []

    def play(messages: list[ChatMessage]) -> ResponseMessage:
        calls.append(1)
        if len(calls) == 1:
            return NAN
        return call("look", {}) if len(messages) == 1 else say("go")

    return play


def _is_nan_failure(t: Trajectory) -> bool:
    return (
        t.status == "failed"
        and t.failure_kind == "infra"
        and t.turns == []
        and t.reward == 0.0
        and t.fallback_reason is not None
        and t.fallback_reason.startswith("nan_generation_logprobs: ")
    )


async def test_nan_generation_logprobs_end_the_rollout_as_an_infra_failure(scripted_gateway, registered_env):
    agent = SwallowingAgent()
    policies: dict[str, Policy] = {
        "nan": lambda messages: NAN,
        "agent": lambda messages: NAN,
        "good": lambda messages: call("look", {}) if len(messages) == 1 else say("go"),
    }
    with registered_env(agent):
        async with scripted_gateway(policies, env={"max_turns": 4}) as stack:
            trajs = await run_tasks(
                stack, [crossing_task("nan", 0), crossing_task("agent", 1, env=agent.name), crossing_task("good", 2)]
            )
            counts = await counter_by_reason(stack, "streamrl_gateway_rollouts_failed")
            worker = stack.gateway.state.worker
            [after] = (await run_tasks(stack, [crossing_task("good", 3)])).values()  # the worker goes on serving
    assert _is_nan_failure(trajs["nan"]), trajs["nan"]
    assert _is_nan_failure(trajs["agent"]), trajs["agent"]  # the agent's own reward 1 does not stand
    [error] = agent.errors
    assert "502" in error and "not numbers" in error, error
    assert trajs["good"].status == "ok" and trajs["good"].reward == 1.0
    assert after.status == "ok" and after.reward == 1.0
    assert counts == {"nan_generation_logprobs": 2.0}
    assert worker.failed == {"nan_generation_logprobs": 2} and worker.retried == {}


async def test_a_nan_rollout_is_retried_under_the_retry_policy(scripted_gateway):
    env = {"max_turns": 4, "failure_policy": "retry", "max_rollout_retries": 1}
    async with scripted_gateway({"flaky": nan_once()}, env=env) as stack:
        [t] = (await run_tasks(stack, [crossing_task("flaky", 0)])).values()
        worker = stack.gateway.state.worker
    assert t.status == "ok" and t.reward == 1.0 and t.metrics["attempts"] == 2.0
    assert worker.retried == {"nan_generation_logprobs": 1} and worker.failed == {}

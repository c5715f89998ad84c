"""Tool calls the model gets wrong, through a real gateway (worker, session proxy, the crossing
environment) whose generator is scripted: each task's model writes one malformed tool call first
(a block that is not JSON, arguments that are not JSON, a block with no name, an unclosed tag, an
unknown tool, a parsed call whose arguments are not JSON), then plays the task right once it was
told what was wrong. An agent in another process (over the session's HTTP routes) writes one too.

What a user relies on:
* ``env.on_tool_call_error: observe`` (the default): the agent sees an error observation and the
  rollout goes on to its reward;
* ``end``: the rollout ends at the bad call as the policy failure ``tool_call_<reason>``
  (truncated, reward 0, the turn kept); an external agent's rollout is judged when it returns;
* either way the calls are counted per reason (the trajectory's metrics and the gateway's
  ``streamrl_gateway_tool_call_errors_total``), and the worker keeps serving: nothing the model
  writes is an environment error or fails the gateway.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.gym_gateway.envs.base import ChatClient, ModelClient, Outcome
from services.gym_gateway.envs.crossing import LOOK_TOOL, RULE
from shared.openai_api import ChatMessage, FunctionCall, ResponseMessage, ToolCall
from shared.protocol import Task
from tests.support.fakes.generator import Policy, call, say, write
from tests.support.gateway import counter_by_reason, crossing_task, run_tasks

pytestmark = pytest.mark.integration

# group-id head -> (the malformed first turn, the reason it is counted under)
MALFORMED: dict[str, tuple[ResponseMessage, str]] = {
    "blockjson": (write('<tool_call>\n{"name": "look", "arguments": {oops}}\n</tool_call>'), "invalid_json"),
    "argsjson": (write('<tool_call>\n{"name": "look", "arguments": "{oops"}\n</tool_call>'), "invalid_arguments"),
    "noname": (write('<tool_call>\n{"arguments": {}}\n</tool_call>'), "missing_name"),
    "unclosed": (write('Looking.\n<tool_call>\n{"name": "look", "arguments": {}}'), "unclosed_tag"),
    "unknown": (call("peek", {}), "unknown_tool"),
    "passedargs": (
        ResponseMessage(
            content="", tool_calls=[ToolCall(id="call_x", function=FunctionCall(name="look", arguments="{oops"))]
        ),
        "invalid_arguments",
    ),
}


def recovering(first: ResponseMessage, seen: list[str]) -> Policy:
    """Writes ``first``; calls look only once the environment answered with an error (kept in
    ``seen``); then acts on the light."""

    def play(messages: list[ChatMessage]) -> ResponseMessage:
        last = messages[-1]
        if len(messages) == 1:
            return first
        if str(last.content).startswith("error"):
            seen.append(str(last.content))
            return call("look", {})
        return say(RULE[re.search(r"light is (\w+)", str(last.content)).group(1)])

    return play


class HttpAgent:
    """An agent in another process, reduced to its model call: one call over the session's HTTP
    routes; it ignores what the model wrote and reports reward 1."""

    name = "http_agent"

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [{} for _ in range(n)]

    async def aclose(self) -> None:
        pass

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        client = ChatClient(llm.base_url, llm.http, timeout_s=30)
        await client.chat([{"role": "user", "content": "look"}], tools=[LOOK_TOOL])
        return Outcome(reward=1.0)


def _policies(seen: dict[str, list[str]]) -> dict[str, Policy]:
    policies = {head: recovering(first, seen.setdefault(head, [])) for head, (first, _) in MALFORMED.items()}
    policies["good"] = recovering(call("look", {}), seen.setdefault("good", []))
    policies["agent"] = lambda messages: write('<tool_call>\n{"name": "look", "arguments": {}}')
    return policies


def _tasks() -> list[Task]:
    return [crossing_task(head, i) for i, head in enumerate([*MALFORMED, "good"])] + [
        crossing_task("agent", 99, env="http_agent")
    ]


EXPECTED_COUNTS = {"invalid_json": 1, "invalid_arguments": 2, "missing_name": 1, "unclosed_tag": 2, "unknown_tool": 1}


async def test_by_default_the_agent_sees_an_error_and_the_rollout_goes_on(scripted_gateway, registered_env):
    seen: dict[str, list[str]] = {}
    with registered_env(HttpAgent()):
        async with scripted_gateway(_policies(seen), env={"max_turns": 4}) as stack:
            trajs = await run_tasks(stack, _tasks())
            counts = await counter_by_reason(stack, "streamrl_gateway_tool_call_errors")
            worker = stack.gateway.state.worker
    for head, (_, reason) in MALFORMED.items():
        t = trajs[head]
        assert t.status == "ok" and t.reward == 1.0 and t.fallback_reason is None, head
        assert t.metrics["model_calls"] == 3 and len(t.turns) == 3, head  # bad call, look, answer
        assert t.metrics[f"tool_call_errors.{reason}"] == 1.0, (head, t.metrics)
        [observation] = seen[head]
        assert observation.startswith("error: "), observation
    assert "no closing </tool_call>" in seen["unclosed"][0] and "unknown tool 'peek'" in seen["unknown"][0]
    good = trajs["good"]
    assert good.status == "ok" and good.reward == 1.0 and good.metrics["model_calls"] == 2 and seen["good"] == []
    assert not any(k.startswith("tool_call_errors") for k in good.metrics)
    agent = trajs["agent"]  # counted over the HTTP routes too; the agent's own outcome stands
    assert agent.status == "ok" and agent.reward == 1.0 and agent.metrics["tool_call_errors.unclosed_tag"] == 1.0
    assert counts == EXPECTED_COUNTS and worker.failed == {}


async def test_on_tool_call_error_end_ends_the_rollout_as_a_policy_failure(scripted_gateway, registered_env):
    seen: dict[str, list[str]] = {}
    with registered_env(HttpAgent()):
        async with scripted_gateway(_policies(seen), env={"max_turns": 4, "on_tool_call_error": "end"}) as stack:
            trajs = await run_tasks(stack, _tasks())
            counts = await counter_by_reason(stack, "streamrl_gateway_tool_call_errors")
            worker = stack.gateway.state.worker
            [after] = (await run_tasks(stack, [crossing_task("good", 100)])).values()  # the worker goes on serving
    for head, (_, reason) in MALFORMED.items():
        t = trajs[head]
        assert t.status == "truncated" and t.reward == 0.0 and t.failure_kind == "policy", head
        assert t.fallback_reason and t.fallback_reason.startswith(f"tool_call_{reason}: "), t.fallback_reason
        assert len(t.turns) == 1 and t.metrics["model_calls"] == 1 and seen[head] == [], head  # ended at the call
        assert t.metrics[f"tool_call_errors.{reason}"] == 1.0
    agent = trajs["agent"]
    assert agent.status == "truncated" and agent.reward == 0.0 and agent.failure_kind == "policy"
    assert (
        agent.fallback_reason and agent.fallback_reason.startswith("tool_call_unclosed_tag: ") and len(agent.turns) == 1
    )
    assert trajs["good"].status == "ok" and trajs["good"].reward == 1.0
    assert after.status == "ok" and after.reward == 1.0
    assert counts == EXPECTED_COUNTS
    assert worker.failed == {f"tool_call_{r}": n for r, n in EXPECTED_COUNTS.items()} and worker.retried == {}

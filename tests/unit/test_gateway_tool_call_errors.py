"""Tool calls the model got wrong, judged by the gateway (`services.gym_gateway.tool_call_errors`):
what counts as unusable, how ``env.on_tool_call_error: end`` labels the rollout, and how the
trainer's step record counts it."""

from __future__ import annotations

import msgspec
import pytest

from services.gym_gateway.envs.base import Outcome, ToolCallFailed, tool_call_error_observation
from services.gym_gateway.proxy import Session
from services.gym_gateway.tool_call_errors import find_tool_call_errors
from services.gym_gateway.worker import assemble, classify
from services.trainer.batch import build_step_batch
from services.trainer.buffer import Group
from shared.config import decode_tree
from shared.config_error import ConfigError
from shared.openai_api import FunctionCall, ResponseMessage, ToolCall, ToolCallError
from shared.protocol import SamplingParams, make_turn
from shared.sections.gateway import EnvSection
from tests.support.messages import make_task

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}]


def _message(*calls: tuple[str, str | dict], errors: list[ToolCallError] | None = None) -> ResponseMessage:
    tool_calls = [ToolCall(id=f"c{i}", function=FunctionCall(name=n, arguments=a)) for i, (n, a) in enumerate(calls)]
    return ResponseMessage(content="", tool_calls=tool_calls or None, tool_call_errors=errors)


def test_good_calls_have_no_errors():
    assert find_tool_call_errors(_message(("look", "{}"), ("look", {"a": 1}), ("look", "")), TOOLS) == []
    assert find_tool_call_errors(ResponseMessage(content="go"), TOOLS) == []


def test_unknown_tools_and_arguments_that_are_not_a_json_object_are_errors():
    errors = find_tool_call_errors(_message(("peek", "{}"), ("look", "{oops"), ("look", "[1, 2]")), TOOLS)
    assert [e.reason for e in errors] == ["unknown_tool", "invalid_arguments", "invalid_arguments"]
    assert "unknown tool 'peek'; tools: look" in errors[0].message


def test_the_generators_parse_errors_come_first_and_no_tools_offered_means_any_name():
    parsed = ToolCallError(reason="unclosed_tag", message="<tool_call> has no closing </tool_call>: {")
    errors = find_tool_call_errors(_message(("peek", "{}"), errors=[parsed]), None)
    assert errors == [parsed]  # "peek" passes: the request named no tools


def test_the_observation_names_each_parse_error():
    msg = _message(errors=[ToolCallError(reason="invalid_json", message="tool call is not valid JSON: {x")])
    assert tool_call_error_observation(msg) == {"role": "user", "content": "error: tool call is not valid JSON: {x"}
    assert tool_call_error_observation(_message(("look", "{}"))) is None


def test_ending_at_a_bad_call_is_a_policy_failure_that_keeps_its_turns_and_is_counted_per_step():
    task = make_task("g", group_size=2, env="crossing", deadline_s=10)
    failure = classify(ToolCallFailed([ToolCallError(reason="unclosed_tag", message="no closing tag")]))
    assert (failure.reason, failure.kind, failure.retryable) == ("tool_call_unclosed_tag", "policy", False)
    turn = make_turn(prompt_ids=[1, 2], context_len=0, generated_ids=[3], generated_logprobs=[-0.1], weight_version=0)
    session = Session("s", "train", SamplingParams(), "gen", "http://g", 0, turns=[turn])
    session.tool_call_errors = {"unclosed_tag": 1}
    cut = assemble(task, session, None, failure, "gw", 0.0)
    assert cut.status == "truncated" and cut.reward == 0.0 and len(cut.turns) == 1
    assert cut.fallback_reason == "tool_call_unclosed_tag: no closing tag" and cut.failure_kind == "policy"
    assert cut.metrics["tool_call_errors.unclosed_tag"] == 1.0
    session = Session("s2", "train", SamplingParams(), "gen", "http://g", 0, turns=[turn])
    fine = assemble(
        msgspec.structs.replace(task, task_id="g/1", index_in_group=1), session, Outcome(1.0), None, "gw", 0
    )
    group = Group("g", 0, 2, 0, rows={0: cut, 1: fine})
    batch = build_step_batch([group], max_len=100, leave_one_out=True, normalize=False)
    assert batch.stats is not None and batch.stats.rollout_failures == {"tool_call_unclosed_tag": 1}
    assert batch.stats.env["tool_call_errors.unclosed_tag"] == 0.5  # a mean over the step's rollouts


def test_the_config_key_defaults_to_observe_and_takes_only_observe_or_end():
    assert EnvSection().on_tool_call_error == "observe"
    assert decode_tree({"on_tool_call_error": "end"}, EnvSection).on_tool_call_error == "end"
    with pytest.raises(ConfigError, match="on_tool_call_error"):
        decode_tree({"on_tool_call_error": "crash"}, EnvSection)

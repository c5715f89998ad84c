"""Parsing generated turns: <think> reasoning and Qwen/Hermes <tool_call> blocks."""

import json

import pytest

from services.generator.tool_calls import parse_turn

pytestmark = pytest.mark.unit


def test_tool_call_becomes_structured_call():
    out = parse_turn(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    )
    assert out.content == "Let me compute."
    [call] = out.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 5
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "1 + 2"}
    assert isinstance(call.function.arguments, str)


def test_only_tool_calls_gives_no_content_and_several_calls_keep_order():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"k\\": 1}"}\n</tool_call>'
    )
    out = parse_turn(text)
    assert out.content is None
    assert [c.function.name for c in out.tool_calls] == ["a", "b"]
    assert json.loads(out.tool_calls[1].function.arguments) == {"k": 1}
    assert out.tool_calls[0].id != out.tool_calls[1].id


def test_invalid_json_stays_as_content():
    text = '<tool_call>\n{"name": "calc", "arguments": {oops}\n</tool_call>'
    out = parse_turn(text)
    assert out.tool_calls == []
    assert out.content == text
    [error] = out.errors
    assert error.reason == "invalid_json" and "not valid JSON" in error.message and "{oops}" in error.message


def test_unclosed_tool_call_stays_as_content():
    out = parse_turn('<tool_call>\n{"name": "calc"')
    assert out.tool_calls == [] and out.content == '<tool_call>\n{"name": "calc"'
    assert [e.reason for e in out.errors] == ["unclosed_tag"] and "</tool_call>" in out.errors[0].message


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"arguments": {}}', "missing_name"),
        ('{"name": 3, "arguments": {}}', "missing_name"),
        ('["calc", {}]', "invalid_json"),
        ('{"name": "calc", "arguments": "{\\"expression\\": 1 +"}', "invalid_arguments"),
    ],
)
def test_a_block_that_cannot_be_a_call_is_reported_with_its_reason(body, reason):
    text = f"<tool_call>\n{body}\n</tool_call>"
    out = parse_turn(text)
    assert out.tool_calls == [] and out.content == text
    assert [e.reason for e in out.errors] == [reason]


def test_good_calls_parse_next_to_bad_ones_and_a_trailing_open_tag_is_unclosed():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        "<tool_call>\n{bad}\n</tool_call>\n"
        '<tool_call>\n{"name": "b", "arguments": {"k": '
    )
    out = parse_turn(text)
    assert [c.function.name for c in out.tool_calls] == ["a"]
    assert [e.reason for e in out.errors] == ["invalid_json", "unclosed_tag"]
    assert out.content == text[text.index("<tool_call>\n{bad}") :].strip()


def test_well_formed_turns_report_no_errors():
    assert parse_turn('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>').errors == []
    assert parse_turn("The answer is 3.").errors == []


def test_leading_think_becomes_reasoning():
    out = parse_turn('<think>\nadd 1 and 2\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>')
    assert out.reasoning_content == "add 1 and 2"
    assert out.content is None and len(out.tool_calls) == 1


def test_reasoning_when_the_prompt_opened_think():
    out = parse_turn("thinking here\n</think>\n\nThe answer is 3.")
    assert out.reasoning_content == "thinking here" and out.content == "The answer is 3."


def test_truncated_reasoning_and_plain_text():
    assert parse_turn("<think>\nstill thinking").reasoning_content == "still thinking"
    plain = parse_turn("just text")
    assert plain.content == "just text" and plain.reasoning_content is None and plain.tool_calls == []


def test_without_tools_the_block_stays_in_content():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    out = parse_turn(text, tool_calls=False)
    assert out.tool_calls == [] and out.content == text
    assert parse_turn("<tool_call>\n{bad", tool_calls=False).errors == []  # no tools offered: no tool calls

"""Responses API <-> chat conversion of the gateway's NeMo-Gym endpoint: NeMo-Gym input items
become the chat messages the generator splices, and a chat answer becomes output items that
OpenAI's own ``Response`` type accepts, with the token fields on the turn's last item."""

from __future__ import annotations

import msgspec
import pytest
from openai.types.responses import Response as OpenAIResponse

from services.gym_gateway.responses import build_response, chat_request
from shared.http import HTTPError
from shared.openai_api import ChatChoice, ChatCompletionResponse, FunctionCall, ResponseMessage, ToolCall, Usage
from shared.responses_api import ResponsesRequest

pytestmark = pytest.mark.unit

TOOL = {
    "type": "function",
    "name": "look",
    "description": "See the light.",
    "strict": True,
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
TOKENS = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [7, 8], "generation_log_probs": [-0.5, -0.25]}


def _req(**fields) -> ResponsesRequest:
    return msgspec.convert(fields, ResponsesRequest)


def _chat_out(content=None, reasoning=None, tool_calls=None, finish="stop") -> ChatCompletionResponse:
    message = ResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls, **TOKENS)
    return ChatCompletionResponse(
        id="chatcmpl-1",
        created=1700000000,
        model="policy",
        choices=[ChatChoice(index=0, message=message, finish_reason=finish, token_ids=[7, 8])],
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        prompt_token_ids=[1, 2, 3],
        weight_version=4,
        weight_version_end=5,
    )


def test_a_replayed_turn_becomes_one_assistant_message_with_its_tokens():
    req = _req(
        input=[
            {"role": "developer", "content": "Be a robot."},
            {"role": "user", "content": [{"type": "input_text", "text": "Look first."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "I should look."}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "look",
                "arguments": "{}",
                "status": "completed",
                **TOKENS,
                "routed_experts": None,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": '{"light": "red"}'},
        ],
        tools=[TOOL],
        max_output_tokens=32,
        temperature=0.7,
    )
    chat = chat_request(req)
    roles = [m.role for m in chat.messages]
    assert roles == ["developer", "user", "assistant", "tool"]
    turn = chat.messages[2]
    assert turn.reasoning_content == "I should look." and turn.content is None
    assert [(c.id, c.function.name, c.function.arguments) for c in turn.tool_calls] == [("call_1", "look", "{}")]
    assert (turn.prompt_token_ids, turn.generation_token_ids, turn.generation_log_probs) == tuple(TOKENS.values())
    assert chat.messages[3].tool_call_id == "call_1" and chat.messages[3].content == '{"light": "red"}'
    assert chat.tools == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    assert chat.max_tokens == 32 and chat.temperature == 0.7


def test_instructions_fold_leading_system_messages_and_a_string_input_is_a_user_turn():
    chat = chat_request(
        _req(
            input=[{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"}], instructions="Be brief."
        )
    )
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief.\n\nRules."), ("user", "Hi")]
    assert [(m.role, m.content) for m in chat_request(_req(input="Hello")).messages] == [("user", "Hello")]


def test_assistant_messages_then_a_user_message_split_turns():
    chat = chat_request(
        _req(
            input=[
                {"role": "user", "content": "a"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "content": [{"type": "output_text", "text": "first", "annotations": []}],
                    **TOKENS,
                },
                {"role": "user", "content": "b"},
            ]
        )
    )
    assert [m.role for m in chat.messages] == ["user", "assistant", "user"]
    assert chat.messages[1].content == "first" and chat.messages[1].generation_token_ids == [7, 8]


def test_null_token_fields_are_read_as_absent():
    nulls = dict.fromkeys(TOKENS)
    [turn] = chat_request(
        _req(input=[{"type": "function_call", "call_id": "c", "name": "look", "arguments": "{}", **nulls}])
    ).messages
    assert turn.tool_calls[0].id == "c" and turn.prompt_token_ids is None and turn.generation_token_ids is None


@pytest.mark.parametrize(
    "item, param",
    [
        ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
        (
            {"type": "function_call", "call_id": "c", "name": "look", "arguments": "{}", "prompt_token_ids": [1]},
            "input[0].generation_token_ids",
        ),
        (
            {
                "type": "function_call",
                "call_id": "c",
                "name": "look",
                "arguments": "{}",
                **TOKENS,
                "generation_log_probs": [-1.0],
            },
            "input[0].generation_log_probs",
        ),
        ({"type": "function_call", "name": "look", "arguments": "{}"}, "input[0]"),
    ],
)
def test_bad_input_items_are_400s_naming_the_item(item, param):
    with pytest.raises(HTTPError) as err:
        chat_request(_req(input=[{"role": "user", "content": "x"}, item][1:]))
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"metadata": {"chat_template_kwargs": "{not json"}}, "metadata.chat_template_kwargs"),
    ],
)
def test_what_chat_cannot_carry_is_refused_by_name(fields, param):
    with pytest.raises(HTTPError) as err:
        chat_request(_req(input="x", **fields))
    assert err.value.param == param


def test_streaming_is_carried_to_the_chat_request_for_the_proxy_to_refuse():
    assert chat_request(_req(input="x", stream=True)).stream is True
    assert chat_request(_req(input="x")).stream is False


def test_template_switches_from_metadata_reach_the_chat_request():
    chat = chat_request(_req(input="x", metadata={"chat_template_kwargs": '{"enable_thinking": false}'}))
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def _valid(resp) -> dict:
    payload = msgspec.to_builtins(resp)
    OpenAIResponse.model_validate(payload)
    return payload


def test_a_tool_call_turn_is_reasoning_then_function_call_carrying_the_tokens():
    call = ToolCall(id="call_9", function=FunctionCall(name="look", arguments="{}"))
    req = _req(input="x", tools=[TOOL], model="policy-model", temperature=1.0)
    payload = _valid(build_response(req, _chat_out(reasoning="look first", tool_calls=[call], finish="tool_calls")))
    kinds = [o["type"] for o in payload["output"]]
    assert kinds == ["reasoning", "function_call"]
    assert payload["output"][0]["summary"] == [{"text": "look first", "type": "summary_text"}]
    assert "prompt_token_ids" not in payload["output"][0]
    fc = payload["output"][1]
    assert (fc["call_id"], fc["name"], fc["arguments"]) == ("call_9", "look", "{}")
    assert {k: fc[k] for k in TOKENS} == TOKENS
    assert payload["status"] == "completed" and payload["model"] == "policy-model" and payload["tools"] == [TOOL]
    assert payload["usage"]["input_tokens"] == 3 and payload["weight_version"] == 4


def test_a_text_turn_cut_by_the_token_cap_is_an_incomplete_message():
    payload = _valid(build_response(_req(input="x"), _chat_out(content="stop", finish="length")))
    [msg] = payload["output"]
    assert msg["type"] == "message" and msg["content"][0]["text"] == "stop" and msg["generation_token_ids"] == [7, 8]
    assert payload["status"] == "incomplete" and payload["incomplete_details"] == {"reason": "max_output_tokens"}
    assert payload["model"] == "policy"


def test_an_empty_turn_is_still_one_message_with_the_tokens():
    [msg] = _valid(build_response(_req(input="x"), _chat_out()))["output"]
    assert msg["content"][0]["text"] == "" and msg["prompt_token_ids"] == [1, 2, 3]


def test_output_items_replayed_as_input_round_trip_to_the_same_turn():
    call = ToolCall(id="call_9", function=FunctionCall(name="look", arguments='{"x": 1}'))
    out = msgspec.to_builtins(build_response(_req(input="x"), _chat_out(content="ok", tool_calls=[call])))["output"]
    [turn] = chat_request(_req(input=out)).messages
    assert turn.content == "ok" and turn.tool_calls[0].function.arguments == '{"x": 1}'
    assert turn.prompt_token_ids == [1, 2, 3] and turn.generation_log_probs == [-0.5, -0.25]

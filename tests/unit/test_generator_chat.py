"""Message normalisation and rendering: every content shape agents send renders as text, bad
input is a 400 naming the field, bookkeeping fields and streamrl's tag never reach the template."""

import pytest

from services.generator.chat import ChatRenderer, normalize_content, normalize_messages, template_kwargs
from shared.http import HTTPError, decode_body
from shared.openai_api import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "content, text",
    [
        ("plain", "plain"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
        ([{"type": "input_text", "text": "a"}, "b"], "a\nb"),
        ({"type": "text", "text": "one part"}, "one part"),
        (None, ""),
        (42, "42"),
        (1.5, "1.5"),
        (("x", {"text": "y"}), "x\ny"),
        ((p for p in ["lazy", "parts"]), "lazy\nparts"),
        (object(), ""),
    ],
)
def test_content_normalisation(content, text):
    assert normalize_content(content, "messages[0].content") == text


def test_image_part_is_a_400_naming_the_part():
    with pytest.raises(HTTPError) as err:
        normalize_content(
            [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}], "messages[2].content"
        )
    assert err.value.status == 400 and err.value.param == "messages[2].content[1]"


def test_unknown_role_is_a_400_naming_the_role():
    with pytest.raises(HTTPError) as err:
        normalize_messages([ChatMessage(role="user", content="hi"), ChatMessage(role="robot", content="beep")])
    assert err.value.status == 400 and err.value.param == "messages[1].role"


def test_bookkeeping_is_stripped_and_tool_calls_are_plain_dicts():
    msg = ChatMessage(
        role="assistant",
        content=None,
        reasoning="hmm",
        prompt_token_ids=[1],
        generation_token_ids=[2],
        generation_log_probs=[-0.1],
        tool_calls=[ToolCall(id="call_1", function=FunctionCall(name="calc", arguments='{"x": 1}'))],
    )
    [out] = normalize_messages([msg])
    assert out == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}],
    }


def test_template_kwargs_drop_the_tag_and_refuse_server_keys():
    assert template_kwargs({"enable_thinking": False, "streamrl": {"kind": "validation"}}) == {"enable_thinking": False}
    with pytest.raises(HTTPError) as err:
        template_kwargs({"add_generation_prompt": False})
    assert err.value.param == "chat_template_kwargs.add_generation_prompt"


def test_extra_client_fields_are_accepted():
    req = decode_body(
        b'{"messages":[{"role":"user","content":"hi","cache_control":{}}],"reasoning_effort":"high",'
        b'"prompt_cache_key":"k","parallel_tool_calls":true}',
        ChatCompletionRequest,
    )
    assert req.messages[0].content == "hi"


@pytest.fixture(scope="module")
def renderer(tiny_tokenizer):
    return ChatRenderer(tiny_tokenizer, None, 0)


def test_render_matches_the_template_text_with_special_tokens_as_single_ids(renderer):
    tok = renderer.tokenizer
    msgs = [
        ChatMessage(role="system", content=[{"type": "text", "text": "be brief"}]),
        ChatMessage(role="user", content="hi"),
    ]
    ids = renderer.chat_prompt(msgs).prompt_ids
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_tools_reach_the_prompt_and_template_kwargs_are_passed(renderer):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    msgs = [ChatMessage(role="user", content="2+2")]
    text = renderer.decode(
        renderer.chat_prompt(msgs, tools=tools, chat_template_kwargs={"enable_thinking": False}).prompt_ids
    )
    assert '"name": "calculator"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tool_turns_render(renderer):
    msgs = [
        ChatMessage(role="user", content="2+2"),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[ToolCall(id="c", function=FunctionCall(name="calc", arguments='{"e": "2+2"}'))],
        ),
        ChatMessage(role="tool", content=4, tool_call_id="c"),
    ]
    text = renderer.decode(renderer.chat_prompt(msgs).prompt_ids)
    assert '<tool_call>\n{"name": "calc", "arguments": {"e": "2+2"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n4\n</tool_response>" in text


def test_unknown_terminator_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="turn_terminator"):
        ChatRenderer(tiny_tokenizer, "<|no_such_token|>", 0)


def test_terminator_text_that_does_not_encode_to_its_id_is_refused(tiny_tokenizer):
    # A tokenizer that splits the terminator into pieces would make the splice count wrong turns.
    class SplittingTokenizer:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __len__(self):
            return len(self._tok)

        def encode(self, text, add_special_tokens=False):
            return self._tok.encode(text.replace("<|im_end|>", "<|im_end"), add_special_tokens=False)

    renderer = ChatRenderer(SplittingTokenizer(tiny_tokenizer), None, 0)
    with pytest.raises(HTTPError) as err:
        renderer.chat_prompt([ChatMessage(role="user", content="hi")])
    assert err.value.status == 500 and "turn terminator" in err.value.message

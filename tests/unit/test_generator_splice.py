"""The prefix splice: the algorithm on plain ids, and through the chat renderer with the tiny model's
real tokenizer and Qwen-style template (think stripping, merged tokens, a non-EOS terminator)."""

import pytest

from services.generator.chat import ChatRenderer, model_prefix
from services.generator.splice import SpliceError, splice_prefix
from shared.http import HTTPError
from shared.openai_api import ChatMessage, FunctionCall, ToolCall

pytestmark = pytest.mark.unit

EOS = 2


def _decode(ids):
    return " ".join(f"<{t}>" for t in ids)


def test_empty_model_prefix_returns_template():
    assert splice_prefix([], [10, 2], [10, 2, 20, 2, 30], EOS, _decode) == [10, 2, 20, 2, 30]


def test_splice_keeps_model_tokens_and_takes_rest_from_template():
    # The model sampled [11] where the template re-renders [99]: the model's token is kept.
    assert splice_prefix([10, 11, 2], [10, 99, 2], [10, 99, 2, 20, 2, 30, 2, 40], EOS, _decode) == [
        10,
        11,
        2,
        20,
        2,
        30,
        2,
        40,
    ]


def test_model_prefix_without_terminator_gets_the_template_terminator():
    # Stopped on max_tokens: no EOS at the end of M; the boundary EOS comes from the template.
    assert splice_prefix([100, 5, 6], [100, 7, 2], [100, 7, 2, 77, 88], EOS, _decode) == [100, 5, 6, 2, 77, 88]


def test_template_prefix_without_terminator_raises_with_both_sides_decoded():
    with pytest.raises(SpliceError) as err:
        splice_prefix([10, 11], [10, 99], [10, 99, 20], EOS, _decode)
    msg = str(err.value)
    assert "no turn terminator" in msg
    assert "<10> <11>" in msg  # model side
    assert "<10> <99> <20>" in msg  # template side


def test_template_with_fewer_terminators_than_history_raises():
    with pytest.raises(SpliceError, match="1 turn terminator"):
        splice_prefix([1, 2, 3, 2], [1, 2, 3, 2], [1, 2, 3, 4], EOS, _decode)


def test_terminator_that_is_not_eos():
    term = 7
    # EOS (2) appears inside turns but only the terminator (7) delimits them.
    out = splice_prefix([1, 2, 5, 7], [1, 2, 9, 7], [1, 2, 9, 7, 2, 30, 7, 40], term, _decode)
    assert out == [1, 2, 5, 7, 2, 30, 7, 40]
    with pytest.raises(SpliceError):
        splice_prefix([1, 2, 5, 2], [1, 2, 9, 2], [1, 2, 9, 2, 30], term, _decode)


# -- through the renderer, with the real tokenizer ------------------------------------------------


@pytest.fixture(scope="module")
def renderer(tiny_tokenizer):
    return ChatRenderer(tiny_tokenizer, None, 0)


def _turn1(renderer, generated_text: str):
    msgs = [ChatMessage(role="user", content="What is 2 + 3?")]
    prompt = renderer.chat_prompt(msgs).prompt_ids
    generated = renderer.tokenizer.encode(generated_text, add_special_tokens=False) + [renderer.terminator_id]
    return msgs, prompt, generated


def test_think_stripping_shifts_positions_but_splice_keeps_model_tokens(renderer):
    msgs, prompt, generated = _turn1(renderer, "<think>\nadd them\n</think>\n\nThe answer is 5.")
    history = msgs + [
        ChatMessage(
            role="assistant",
            content="The answer is 5.",
            reasoning_content="add them",
            prompt_token_ids=prompt,
            generation_token_ids=generated,
        ),
        ChatMessage(role="user", content="And 4 + 4?"),
    ]
    out = renderer.chat_prompt(history)
    m = prompt + generated
    # The template drops the earlier turn's reasoning in T: the assistant turn's terminator (the
    # 2nd) sits earlier in T than in the model's tokens, but it is still the 2nd.
    t_ends = [i for i, t in enumerate(out.template_ids) if t == renderer.terminator_id]
    assert t_ends[1] < len(m) - 1
    assert "<think>" not in renderer.decode(out.template_ids)
    assert out.prompt_ids[: len(m)] == m
    tail = renderer.decode(out.prompt_ids[len(m) - 1 :])
    assert tail.startswith("<|im_end|>\n<|im_start|>user\nAnd 4 + 4?<|im_end|>\n<|im_start|>assistant\n")


def _merged_pair(tok):
    """(token a, token b, token ab) where the text of a+b re-tokenises to the single token ab."""
    vocab = tok.get_vocab()
    for text, ab in sorted(vocab.items(), key=lambda kv: kv[1]):
        if len(text) < 3 or text.startswith("<"):
            continue
        a, b = vocab.get(text[:1]), vocab.get(text[1:])
        if a is None or b is None:
            continue
        decoded = tok.decode([a, b])
        if tok.encode(decoded, add_special_tokens=False) == [ab]:
            return a, b, ab
    raise AssertionError("no mergeable pair in the vocabulary")


def test_two_tokens_that_retokenise_to_one_are_kept_as_two(renderer):
    tok = renderer.tokenizer
    a, b, ab = _merged_pair(tok)
    msgs, prompt, _ = _turn1(renderer, "")
    generated = [a, b, renderer.terminator_id]
    history = msgs + [
        ChatMessage(
            role="assistant", content=tok.decode([a, b]), prompt_token_ids=prompt, generation_token_ids=generated
        ),
        ChatMessage(role="user", content="again"),
    ]
    out = renderer.chat_prompt(history)
    assert ab in out.template_ids[len(prompt) :]  # the template re-tokenised the pair as one token
    assert out.prompt_ids[: len(prompt) + 3] == prompt + [a, b, renderer.terminator_id]
    assert ab not in out.prompt_ids[len(prompt) : len(prompt) + 3]


def test_required_prefix_takes_precedence_and_checks_vocabulary(renderer):
    msgs, prompt, generated = _turn1(renderer, "five")
    history = msgs + [ChatMessage(role="assistant", content="five"), ChatMessage(role="user", content="ok")]
    out = renderer.chat_prompt(history, required_prefix_token_ids=prompt + generated)
    assert out.prompt_ids[: len(prompt) + len(generated)] == prompt + generated
    with pytest.raises(HTTPError) as err:
        renderer.chat_prompt(history, required_prefix_token_ids=[10**6])
    assert err.value.param == "required_prefix_token_ids"


def test_splice_failure_is_a_400_with_both_sides_decoded(renderer):
    # A terminator the template never writes: k == 0.
    other = ChatRenderer(renderer.tokenizer, "<tool_response>", 0)
    msgs, prompt, generated = _turn1(renderer, "five")
    history = msgs + [
        ChatMessage(role="assistant", content="five", prompt_token_ids=prompt, generation_token_ids=generated),
        ChatMessage(role="user", content="ok"),
    ]
    with pytest.raises(HTTPError) as err:
        other.chat_prompt(history)
    assert err.value.status == 400
    assert "What is 2 + 3?" in err.value.message and "five" in err.value.message
    assert "<tool_response>" in err.value.message


def test_model_prefix_comes_from_the_last_assistant_carrying_ids():
    a1 = ChatMessage(role="assistant", content="x", prompt_token_ids=[1], generation_token_ids=[2])
    a2 = ChatMessage(role="assistant", content="y", prompt_token_ids=[1, 2, 3], generation_token_ids=[4, 5])
    user = ChatMessage(role="user", content="u")
    assert model_prefix([user, a1, user, a2, user], None) == ([1, 2, 3, 4, 5], 3)
    assert model_prefix([user, a1, user], None) == ([1, 2], 1)
    assert model_prefix([user], None) == ([], 0)
    with pytest.raises(HTTPError) as err:
        model_prefix([user, ChatMessage(role="assistant", content="z", prompt_token_ids=[1])], None)
    assert err.value.param == "messages[1].generation_token_ids"


# A Qwen3.5-style template: every assistant turn is re-rendered from the *normalised*
# ``reasoning_content`` (never stripped), so the history render P must see the same normalised
# messages as the full render T (spec 8.5).
QWEN35_STYLE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' -}}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<think>\\n' ~ (m.reasoning_content or '') ~ '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_history_is_rendered_from_the_normalised_messages(tiny_tokenizer):
    import copy

    tok = copy.copy(tiny_tokenizer)
    tok.chat_template = QWEN35_STYLE
    r = ChatRenderer(tok, None, 0)
    msgs, prompt, generated = _turn1(r, "<think>\nadd them\n</think>\n\nfive")
    history = msgs + [
        # "reasoning" (the newer OpenAI field name) and list-of-parts content: both normalised.
        ChatMessage(
            role="assistant",
            content=[{"type": "text", "text": "five"}],
            reasoning="add them",
            prompt_token_ids=prompt,
            generation_token_ids=generated,
        ),
        ChatMessage(role="user", content="ok"),
    ]
    out = r.chat_prompt(history)
    assert "<think>\nadd them\n</think>" in out.history_text
    assert r.decode(out.template_ids).startswith(out.history_text)  # P is T's view of the history
    m = prompt + generated
    assert out.prompt_ids[: len(m)] == m
    assert (
        r.decode(out.prompt_ids[len(m) - 1 :]) == "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_call_json_that_reserialises_differently_keeps_the_model_tokens(renderer):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    msgs = [ChatMessage(role="user", content="What is 2 + 3?")]
    prompt = renderer.chat_prompt(msgs, tools=tools).prompt_ids
    said = '<tool_call>\n{"name": "calculator", "arguments": {"a": 2,  "b": 3}}\n</tool_call>'
    generated = renderer.tokenizer.encode(said, add_special_tokens=False) + [renderer.terminator_id]
    for arguments in ('{"a":2,"b":3}', {"a": 2, "b": 3}):  # compact string, or the object itself
        call = ToolCall(id="call_1", function=FunctionCall(name="calculator", arguments=arguments))
        history = msgs + [
            ChatMessage(
                role="assistant",
                content=None,
                tool_calls=[call],
                prompt_token_ids=prompt,
                generation_token_ids=generated,
            ),
            ChatMessage(role="tool", tool_call_id="call_1", content="5"),
        ]
        out = renderer.chat_prompt(history, tools=tools)
        assert out.template_ids[: len(prompt) + len(generated)] != prompt + generated  # the render differs
        m = prompt + generated
        assert out.prompt_ids[: len(m)] == m
        tail = renderer.decode(out.prompt_ids[len(m) - 1 :])
        assert (
            tail
            == "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )

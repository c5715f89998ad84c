"""The generator through the official ``openai`` Python client, as agents call it: chat with tools,
tool results, list-of-parts content, n > 1, logprobs, seeds, text stops, both token caps, the extra
fields LiteLLM-based agents send, and errors raised as the client's own exception types.

The server is the real app with the transformers engine, in-process (the client's httpx transport
is bound to it). One model is fine-tuned to answer a fixed prompt with reasoning and a tool call,
so the parsing of real model output into ``reasoning_content`` and ``tool_calls`` is tested end to
end; the second turn sends that answer back the way the client serialises it and must keep the
model's own tokens.
"""

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "Use the calculator."}
USER = {"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}
ANSWER = (
    '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)


def _client(gen) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gen.app), base_url="http://generator")
    return openai.AsyncOpenAI(base_url="http://generator/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def tool_model(tiny_model_dir, tiny_tokenizer, scripted_model, tmp_path_factory):
    """The tiny model fine-tuned to answer SYSTEM + USER (with TOOLS) with ANSWER."""
    prompt = tiny_tokenizer.apply_chat_template(
        [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tiny_tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    return scripted_model(tiny_model_dir, tmp_path_factory.mktemp("tool-model"), prompt_ids, answer_ids)


@pytest.fixture
async def greedy_gen(hf_generator, tool_model):
    # Validation requests (tagged) sample greedily; training requests at temperature 0.8.
    async with hf_generator(model_dir=tool_model, val_temperature=0.0, max_new_tokens=64) as g:
        yield g


@pytest.fixture
async def gen(hf_generator):
    async with hf_generator() as g:
        yield g


VALIDATION = {"streamrl": {"kind": "validation"}}


async def test_tool_call_and_reasoning_from_real_model_output(greedy_gen):
    client = _client(greedy_gen)
    raw = await client.chat.completions.with_raw_response.create(
        model="policy",
        messages=[SYSTEM, USER],
        tools=TOOLS,
        temperature=0.0,
        max_completion_tokens=64,
        logprobs=True,
        top_logprobs=2,
        extra_body=VALIDATION,
    )
    # Strict validation against the client's schema (the client itself parses leniently).
    out = ChatCompletion.model_validate_json(raw.http_response.text)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "add them"
    generated = choice.message.model_extra["generation_token_ids"]
    assert [t.token for t in choice.logprobs.content] == [f"token_id:{t}" for t in generated]
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert out.usage.completion_tokens == len(generated)

    # Turn 2 as an agent sends it: the client's own serialisation of the call (compact JSON, not
    # what the model wrote), a tool result, and the token ids echoed on the assistant message.
    msg = choice.message
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"a": 2, "b": 3}, separators=(",", ":"))},
            }
        ],
        "prompt_token_ids": msg.model_extra["prompt_token_ids"],
        "generation_token_ids": generated,
    }
    tool = {"role": "tool", "tool_call_id": call.id, "content": "5"}
    second = await client.chat.completions.create(
        model="policy",
        messages=[SYSTEM, USER, assistant, tool],
        tools=TOOLS,
        max_tokens=4,
        extra_body=VALIDATION,
    )
    seen = msg.model_extra["prompt_token_ids"] + generated
    prompt2 = second.model_extra["prompt_token_ids"]
    assert prompt2[: len(seen) - 1] == seen[:-1]  # the model's tokens up to its own terminator
    tokenizer = greedy_gen.app.state.renderer.tokenizer
    assert tokenizer.decode(prompt2[len(seen) - 1 :]).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n5")


async def test_sampling_options_and_agent_extras(gen):
    client = _client(gen)
    kwargs = dict(model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, seed=11)
    a = await client.chat.completions.create(n=3, **kwargs)
    b = await client.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    ids = [c.message.model_extra["generation_token_ids"] for c in a.choices]
    assert ids == [c.message.model_extra["generation_token_ids"] for c in b.choices]  # same seed
    assert all(1 <= len(x) <= 6 for x in ids)
    capped = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        reasoning_effort="low",
        prompt_cache_key="session-1",
        extra_body={"parallel_tool_calls": False, "metadata": {"agent": "x"}},
    )
    assert len(capped.choices[0].message.model_extra["generation_token_ids"]) <= 3

    # A text stop: the content ends before it, the tokens end with the one that completed it.
    [free] = (await client.chat.completions.create(temperature=0.8, **kwargs)).choices
    text = free.message.content or ""
    assert len(text) >= 6, text
    stop = text[3:5]
    [cut] = (await client.chat.completions.create(stop=[stop], **kwargs)).choices
    assert cut.finish_reason == "stop"
    assert (cut.message.content or "") == text[: text.find(stop)]
    kept = cut.message.model_extra["generation_token_ids"]
    assert kept == free.message.model_extra["generation_token_ids"][: len(kept)]


async def test_errors_are_the_clients_exception_types(gen):
    client = _client(gen)
    with pytest.raises(openai.BadRequestError) as off_policy:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Hi"}], temperature=0.3
        )
    assert off_policy.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as overflow:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 3000}])
    assert overflow.value.body["type"] == "invalid_request_error"
    assert "maximum context length" in overflow.value.body["message"]
    with pytest.raises(openai.BadRequestError) as image:
        await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}],
        )
    assert image.value.body["param"] == "messages[0].content[0]"

"""The generator's HTTP surface, served in-process with the transformers engine on the tiny model,
registered in a real Valkey: response contract, 400s naming the field, the sampling gate,
the splice across turns, admission while paused."""

import asyncio

import msgspec
import pytest

from shared.admin_api import GeneratorState
from shared.keys import RunKeys
from shared.openai_api import ChatCompletionResponse, CompletionResponse
from shared.registry import live_workers
from shared.streams import connect

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "What is 2 + 3?"}
LONG_SAMPLE_SEED = 7  # the tiny model's answer to USER under this seed runs to 300 tokens


@pytest.fixture
async def gen(hf_generator):
    async with hf_generator() as g:
        yield g


async def _chat(gen, **body) -> ChatCompletionResponse:
    r = await gen.client.post("/v1/chat/completions", json={"messages": [USER], **body})
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=ChatCompletionResponse)


async def _error(gen, path: str, body, status: int = 400) -> dict:
    r = await gen.client.post(path, content=body) if isinstance(body, bytes) else await gen.client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()["error"]


async def test_chat_response_carries_exact_tokens_and_logprobs(gen, tiny_model_dir, logprob_reference):
    out = await _chat(gen, n=2, max_tokens=8, logprobs=True, top_logprobs=3, seed=7)
    tok = await gen.client.post("/tokenize", json={"messages": [USER]})
    assert out.prompt_token_ids == tok.json()["tokens"]
    assert out.weight_version == out.weight_version_end == -1
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        m = c.message
        assert m.prompt_token_ids == out.prompt_token_ids
        assert 1 <= len(m.generation_token_ids) == len(m.generation_log_probs) <= 8
        assert [e.token for e in c.logprobs.content] == [f"token_id:{t}" for t in m.generation_token_ids]
        assert [e.logprob for e in c.logprobs.content] == m.generation_log_probs
        assert all(len(e.top_logprobs) == 3 for e in c.logprobs.content)
        # Logprobs under the temperature-scaled distribution of the served weights.
        ref = logprob_reference(
            tiny_model_dir, out.prompt_token_ids, m.generation_token_ids, gen.cfg.policy.generation.temperature
        )
        assert max(abs(a - b) for a, b in zip(ref, m.generation_log_probs, strict=True)) < 1e-4
    assert out.usage.prompt_tokens == len(out.prompt_token_ids)
    assert out.usage.completion_tokens == sum(len(c.message.generation_token_ids) for c in out.choices)


async def test_second_turn_keeps_first_turn_tokens(gen):
    first = await _chat(gen, max_tokens=6)
    m1 = first.choices[0].message
    history = [
        USER,
        {
            "role": "assistant",
            "content": m1.content,
            "prompt_token_ids": m1.prompt_token_ids,
            "generation_token_ids": m1.generation_token_ids,
            "generation_log_probs": m1.generation_log_probs,
        },
        {"role": "user", "content": "And 4 + 4?"},
    ]
    r = await gen.client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4})
    assert r.status_code == 200, r.text
    second = msgspec.json.decode(r.content, type=ChatCompletionResponse)
    seen = m1.prompt_token_ids + m1.generation_token_ids
    assert second.prompt_token_ids[: len(seen)] == seen
    tok = await gen.client.post("/tokenize", json={"messages": history})
    assert tok.json()["tokens"] == second.prompt_token_ids


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [USER], "n": "two"}, "n"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({}, None),
        ({"messages": [USER], "temperature": 0.3}, "temperature"),
        ({"messages": [USER], "top_k": 20}, "top_k"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [USER], "stream": True}, "stream"),
        ({"messages": [USER], "stop": ["ok", ""]}, "stop[1]"),
        ({"messages": [USER], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(gen, body, param):
    err = await _error(gen, "/v1/chat/completions", body)
    assert err["type"] == "invalid_request_error"
    if param is None:
        assert "messages" in err["message"]
    else:
        assert err["param"] == param, err


async def test_invalid_json_and_empty_body(gen):
    assert "not valid JSON" in (await _error(gen, "/v1/chat/completions", b"{nope"))["message"]
    assert "empty" in (await _error(gen, "/v1/chat/completions", b""))["message"]


async def test_context_overflow_and_budget_clamp(gen):
    long_text = "word " * 3000  # far beyond max_model_len 1024
    err = await _error(gen, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]})
    assert err["type"] == "invalid_request_error" and "maximum context length" in err["message"]
    out = await _chat(gen, max_tokens=10_000, reasoning_effort="high", prompt_cache_key="abc")
    assert len(out.choices[0].message.generation_token_ids) <= gen.cfg.policy.generation.max_new_tokens


async def test_validation_tag_selects_the_validation_profile(gen):
    val = gen.cfg.policy.generation.val_temperature
    ok = await gen.client.post(
        "/v1/chat/completions",
        json={"messages": [USER], "temperature": val, "max_tokens": 2, "streamrl": {"kind": "validation"}},
    )
    assert ok.status_code == 200, ok.text
    err = await _error(gen, "/v1/chat/completions", {"messages": [USER], "temperature": val, "max_tokens": 2})
    assert err["param"] == "temperature"


async def test_completions_models_and_metrics(gen):
    r = await gen.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2})
    assert r.status_code == 200, r.text
    out = msgspec.json.decode(r.content, type=CompletionResponse)
    c = out.choices[0]
    assert out.prompt_token_ids == [5, 6, 7] and len(c.generation_token_ids) == 3
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.generation_token_ids]
    assert all(len(d) >= 2 for d in c.logprobs.top_logprobs)
    models = (await gen.client.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 1024
    metrics = (await gen.client.get("/metrics")).text
    assert 'streamrl_generator_requests_total{route="completions",status="200"} 1.0' in metrics
    assert "streamrl_event_loop_lag_seconds" in metrics and "streamrl_generator_weight_version -1.0" in metrics


async def test_registered_with_heartbeat_and_deregistered_on_shutdown(hf_generator, redis_url):
    redis = connect(redis_url)
    try:
        async with hf_generator() as g:
            keys = RunKeys(g.cfg.run.run_id)
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # the record follows the state within a heartbeat interval
                [hb] = await live_workers(redis, keys, "generator")
                if hb.state == "ready" or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert hb.worker_id == g.runtime.worker_id and hb.state == "ready" and hb.weight_version == -1
            assert hb.url.startswith("http://127.0.0.1:")
        assert await live_workers(redis, keys, "generator") == []
    finally:
        await redis.aclose()


async def test_pause_holds_new_requests_until_resume(gen):
    r = await gen.client.post("/admin/pause", json={"mode": "drain"})
    assert r.status_code == 200 and r.json()["state"] == "paused"
    pending = asyncio.create_task(_chat(gen, max_tokens=2))
    deadline = asyncio.get_running_loop().time() + 30
    while True:  # the request arrives and is held: the generator's own count says so
        state = msgspec.json.decode((await gen.client.get("/admin/state")).content, type=GeneratorState)
        if state.waiting or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert state.waiting == 1 and state.in_flight == 0 and not pending.done()
    assert (await gen.client.get("/ready")).status_code == 200  # paused is still a serving state
    await gen.client.post("/admin/resume")
    out = await asyncio.wait_for(pending, 30)
    assert len(out.choices[0].message.generation_token_ids) >= 1
    err = await _error(gen, "/admin/pause", {"mode": "later"})
    assert err["param"] == "mode"


async def test_keep_pause_freezes_a_running_request(hf_generator, until_generating):
    async with hf_generator(max_new_tokens=300) as g:
        engine = g.runtime.engine
        # Seed 7's sample on the tiny model runs the whole 300 tokens: an unseeded one can stop
        # at an end-of-sequence token before the pause lands.
        running = asyncio.create_task(_chat(g, max_tokens=300, seed=LONG_SAMPLE_SEED))
        await until_generating(engine, running)
        await g.client.post("/admin/pause", json={"mode": "keep"})
        frozen_at = engine.stats().generated_tokens_total
        await asyncio.sleep(0.5)
        assert engine.stats().generated_tokens_total == frozen_at and not running.done()
        await g.client.post("/admin/resume")
        out = await asyncio.wait_for(running, 120)
        assert len(out.choices[0].message.generation_token_ids) == engine.stats().generated_tokens_total > frozen_at


def _random_json(rng, depth: int = 0):
    """A random JSON value of the shapes agents get wrong: nesting, nulls, numbers, odd keys."""
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict", "part"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return rng.choice(["", "hi", "<|im_end|>", "<tool_call>\n{", "ü\u0000", "{{ x }}"])
    if kind == "int":
        return rng.choice([0, -1, 2**40, 7])
    if kind == "float":
        return rng.choice([0.5, -1e300, 1e-9])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "part":
        return {
            "type": rng.choice(["text", "input_text", "image_url", "refusal", None, 3]),
            "text": _random_json(rng, depth + 1),
        }
    keys = ["text", "type", "content", "role", "name", "tool_calls", "function", "arguments", "id"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _random_message(rng) -> dict:
    msg = {
        "role": rng.choice(["user"] * 6 + ["assistant", "tool", "system", "developer", "robot", 5, None]),
        "content": _random_json(rng),
    }
    for key in ("tool_calls", "tool_call_id", "name", "reasoning_content", "prompt_token_ids", "generation_token_ids"):
        if rng.random() < 0.2:
            msg[key] = _random_json(rng)
    if rng.random() < 0.1:
        msg["prompt_token_ids"], msg["generation_token_ids"] = [rng.randint(-5, 2000)], [rng.randint(0, 900)]
    return msg


async def test_no_message_shape_gives_a_500(gen):
    """Hundreds of random, mostly malformed requests: each is answered 200 or a 4xx naming what
    is wrong, never a server error."""
    import random

    rng = random.Random(1234)
    answered = {200: 0, 400: 0}
    for i in range(300):
        body = {"messages": [_random_message(rng) for _ in range(rng.randint(1, 4))]}
        if rng.random() < 0.3:
            body["tools"] = _random_json(rng)
        if rng.random() < 0.2:
            body["required_prefix_token_ids"] = _random_json(rng)
        path = "/v1/chat/completions" if i % 10 == 0 else "/tokenize"
        if path.startswith("/v1"):
            body["max_tokens"] = 1
        r = await gen.client.post(path, json=body)
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
        answered[r.status_code] += 1
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], err
    assert answered[200] > 10 and answered[400] > 10, answered

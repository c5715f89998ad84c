"""The Engine contract, run against every backend: the transformers engine in-process
(integration); the vLLM engine when STREAMRL_VLLM_CONTRACT_CHILD=1, which
tests/e2e/test_generator_vllm.py sets for a child pytest process of its own (~30 s to start).

Why a child process: once an in-process vLLM engine has shut down, the event loop it ran on keeps
registrations of vLLM's ZMQ sockets, and later Redis reads on that loop stall until their socket
timeout. The generator service is unaffected (it closes the engine last), but a test session that
shares one event loop across tests is not.
"""

import asyncio
import os
import time

import pytest

from services.generator.engine import Engine, GenerationParams, build_engine
from shared.config import decode_tree
from shared.run_config import RunConfig

IN_CHILD = os.environ.get("STREAMRL_VLLM_CONTRACT_CHILD") == "1"
PROMPT = [1, 355, 207, 567, 291, 229, 26, 2, 207, 1, 367, 207]

BACKENDS = ["vllm"] if IN_CHILD else [pytest.param("transformers", marks=pytest.mark.integration)]


@pytest.fixture(scope="module", params=BACKENDS)
async def engine(request, tiny_model_dir, generator_config_tree):
    tree = generator_config_tree(tiny_model_dir, run_id="contract", redis_url=None, backend=request.param)
    tree["refit"] = {"transport": "collective"}  # the engine also takes weights over a transfer group
    # Real weights at start (collective runs start vLLM on random ones: test_random_start_*).
    tree["policy"]["generation"].setdefault("vllm_cfg", {})["load_format"] = "auto"
    eng = build_engine(decode_tree(tree, RunConfig))
    await eng.start()
    yield eng
    await eng.aclose()


def greedy(max_tokens: int, **kw) -> GenerationParams:
    return GenerationParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, **kw)


async def test_is_an_engine_with_a_context_length(engine):
    assert isinstance(engine, Engine)
    assert engine.info.max_model_len == 1024 and not engine.errored


async def test_choices_tokens_and_logprobs(engine):
    params = GenerationParams(temperature=0.8, top_p=1.0, max_tokens=6, n=3, seed=5, top_logprobs=2)
    choices = await engine.generate(PROMPT, params, "c1")
    assert [c.index for c in choices] == [0, 1, 2]
    for c in choices:
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 6
        assert c.finish_reason in ("stop", "length")
        assert len(c.top_logprobs) == len(c.token_ids)
        for alts in c.top_logprobs:
            assert len(alts) == 2 and alts[0][1] >= alts[1][1]
    again = await engine.generate(PROMPT, params, "c2")
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]  # same seed, same samples


async def test_stop_token_is_included_and_greedy_logprobs_are_raw(engine, tiny_model_dir, logprob_reference):
    [free] = await engine.generate(PROMPT, greedy(4), "g1")
    ref = logprob_reference(tiny_model_dir, PROMPT, free.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(ref, free.logprobs, strict=True)) < 1e-3
    first = free.token_ids[0]
    [stopped] = await engine.generate(PROMPT, greedy(4, stop_token_ids=(first,)), "g2")
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


async def test_text_stop_ends_on_the_token_that_completes_it(engine, tiny_tokenizer):
    [free] = await engine.generate(PROMPT, greedy(8), "t1")
    assert len(free.token_ids) == 8, "the greedy continuation must not stop early for this test"
    decode = lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    # Two generated tokens whose text is whole characters (a byte-level piece of a multi-byte
    # character decodes to U+FFFD, which an incremental detokenizer never emits).
    stop = next(text for i in range(7) if (text := decode(free.token_ids[i : i + 2])).strip() and "\ufffd" not in text)
    # The first prefix of the free continuation whose text contains the stop string.
    k = next(i for i in range(1, 9) if stop in decode(free.token_ids[:i]))
    [stopped] = await engine.generate(PROMPT, greedy(8, stop_strings=(stop,)), "t2")
    assert stopped.token_ids == free.token_ids[:k] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(free.logprobs[:k], abs=1e-4)


# (temperature, top_p) of the nucleus check: narrow and wide nuclei, cold and hot
NUCLEI = [(1.0, 0.5), (0.8, 0.9), (0.6, 0.7), (1.3, 0.95)]


async def test_sampled_logprobs_are_the_trainers_nucleus_scoring(engine, tiny_model_dir):
    """At several top_p < 1 and temperatures, the logprobs the engine reports for the tokens it
    sampled (vLLM: its own sampler's processed logprobs) are what the trainer computes for them
    from a transformers forward pass (`shared_torch.nucleus.sampled_logprobs`, as the loss scores
    them), within 1e-3; scored without the truncation they are not (the bias the nucleus scoring
    removes), so a trainer that dropped it would fail here."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared_torch.nucleus import sampled_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    worst, truncation = 0.0, 0.0
    for k, (temperature, top_p) in enumerate(NUCLEI):
        params = GenerationParams(temperature=temperature, top_p=top_p, max_tokens=16, n=6, seed=20 + k)
        for c in await engine.generate(PROMPT, params, f"nucleus-{k}"):
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([PROMPT + c.token_ids])).logits[0, len(PROMPT) - 1 : -1]
            ours, plain = sampled_logprobs(logits, torch.tensor(c.token_ids), temperature, top_p, untruncated=True)
            assert plain is not None
            engine_lp = torch.tensor(c.logprobs, dtype=torch.float32)
            worst = max(worst, float((ours - engine_lp).abs().max()))
            truncation = max(truncation, float((plain - engine_lp).abs().max()))
    assert worst < 1e-3, f"trainer and engine disagree by {worst:.2e} nats on a sampled token"
    assert truncation > 0.05, "no sampled token's logprob changed under the truncation: the test shows nothing"


async def test_pause_load_reset_resume(engine, tiny_model_dir, perturbed_model, logprob_reference, tmp_path_factory):
    new = perturbed_model(tiny_model_dir, tmp_path_factory.mktemp("contract-v1"), scale=0.05, seed=9)
    await engine.pause("drain")
    await engine.load_weights(str(new))
    assert await engine.reset_prefix_cache() is engine.prefix_caching_enabled
    await engine.resume()
    [c] = await engine.generate(PROMPT, greedy(4), "w1")
    ref = logprob_reference(new, PROMPT, c.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-3
    await engine.pause("drain")
    await engine.load_weights(str(tiny_model_dir))
    await engine.reset_prefix_cache()
    await engine.resume()


async def test_refit_matches_a_cold_start_on_the_new_weights(
    engine, tiny_model_dir, perturbed_model, generator_config_tree, tmp_path_factory
):
    """After pause -> load -> cache reset -> resume, a prompt whose KV blocks were cached under the
    old weights scores exactly as on an engine started cold on the new weights."""
    long_prompt = (PROMPT * 40)[:400]  # several whole KV blocks: the prefix cache holds them
    params = greedy(6, top_logprobs=3)
    await engine.generate(long_prompt, params, "cold-1")  # cache the prefix under the old weights
    new = perturbed_model(tiny_model_dir, tmp_path_factory.mktemp("contract-cold"), scale=0.05, seed=21)
    await engine.pause("drain")
    await engine.load_weights(str(new))
    assert await engine.reset_prefix_cache() is engine.prefix_caching_enabled
    await engine.resume()
    [warm] = await engine.generate(long_prompt, params, "cold-2")
    await assert_scores_as_cold_start(warm, engine, new, long_prompt, params, generator_config_tree)
    await restore(engine, tiny_model_dir)


async def assert_scores_as_cold_start(warm, engine, weights, prompt, params, config_tree) -> None:
    """``warm`` (what ``engine`` answered after taking ``weights`` in place) equals the answer of an
    engine of the same backend started cold on ``weights``: tokens, logprobs, alternatives."""
    backend = "vllm" if engine.info.name == "vllm" else "transformers"
    cold_engine = build_engine(
        decode_tree(config_tree(weights, run_id="cold", redis_url=None, backend=backend), RunConfig)
    )
    await cold_engine.start()
    try:
        [cold] = await cold_engine.generate(prompt, params, "cold")
    finally:
        await cold_engine.aclose()
    assert warm.token_ids == cold.token_ids
    assert warm.logprobs == pytest.approx(cold.logprobs, abs=1e-5)
    for w, c in zip(warm.top_logprobs or [], cold.top_logprobs or [], strict=True):
        assert [t for t, _ in w] == [t for t, _ in c]
        assert [v for _, v in w] == pytest.approx([v for _, v in c], abs=1e-5)


async def restore(engine, weights) -> None:
    await engine.pause("drain")
    await engine.load_weights(str(weights))
    await engine.reset_prefix_cache()
    await engine.resume()


class _EngineClient:
    """vLLM's trainer-side client protocol, straight to ``engine`` on ``loop`` (the generator
    service reaches its engine the same way, from the weights stream)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop
        self.received: str | None = None

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def init_weight_transfer_engine(self, init_info):
        self._run(self.engine.join_weight_group({**init_info, "rank_offset": 1}))

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        self.received = self._run(self.engine.receive_weights(update_info))

    def finish_weight_update(self, weight_version=None):
        pass


async def test_collective_refit_matches_a_cold_start_on_the_new_weights(
    engine, tiny_model_dir, perturbed_model, generator_config_tree, tmp_path_factory
):
    """Weights received over a transfer group (vLLM's weight-transfer engine; gloo here) score
    exactly as an engine started cold on the same weights, and both sides agree on the checksum."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.weight_send import CollectiveSender, SendOrder, weight_source
    from streamrl.redis_server import free_port

    class Policy:  # what a collective refit reads from a training backend
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
            return [(n, tuple(t.shape)) for n, t in self.model.state_dict().items()]

        def weight_tensors(self):
            return iter(self.model.state_dict().items())

    long_prompt = (PROMPT * 40)[:400]
    params = greedy(6, top_logprobs=3)
    await engine.generate(long_prompt, params, "coll-1")  # cache the prefix under the old weights
    new = perturbed_model(tiny_model_dir, tmp_path_factory.mktemp("contract-coll"), scale=0.05, seed=23)
    model = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32)
    sender = CollectiveSender(weight_source(Policy(model), torch.float32), rank=0)
    client = _EngineClient(engine, asyncio.get_running_loop())
    order = SendOrder(
        group_id="contract",
        backend="gloo",
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        timeout_s=60.0,
        bucket_bytes=1 << 20,  # many buckets
    )
    await engine.pause("drain")
    sent = await asyncio.to_thread(sender.send, order, client)
    assert await engine.reset_prefix_cache() is engine.prefix_caching_enabled
    await engine.resume()
    sender.close()
    assert sent is not None and sent == client.received
    [warm] = await engine.generate(long_prompt, params, "coll-2")
    await assert_scores_as_cold_start(warm, engine, new, long_prompt, params, generator_config_tree)
    await restore(engine, tiny_model_dir)


async def test_keep_pause_holds_requests_until_resume(engine):
    await engine.pause("keep")
    task = asyncio.create_task(engine.generate(PROMPT, greedy(3), "k1"))
    await asyncio.sleep(0.5)
    assert not task.done()
    await engine.resume()
    [c] = await asyncio.wait_for(task, 60)
    assert len(c.token_ids) == 3


async def test_interrupt_pause_ends_running_requests_with_their_tokens(engine):
    """What a refit with in-flight weight updates relies on: the running request ends at once,
    finish reason ``abort``, with the tokens it generated (a prefix of what it would have
    generated), so the generator can continue it on the new weights."""
    n = 600
    t0 = time.monotonic()
    [whole] = await engine.generate(PROMPT, greedy(n), "i0")
    took = time.monotonic() - t0
    if whole.finish_reason != "length":
        pytest.skip(f"greedy decoding of the prompt stops after {len(whole.token_ids)} tokens")
    task = asyncio.create_task(engine.generate(PROMPT, greedy(n), "i1"))
    await asyncio.sleep(took / 3)  # about a third of the way, on a machine of any speed
    await engine.pause("interrupt")
    try:
        [c] = await asyncio.wait_for(task, 60)
    finally:
        await engine.resume()
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) == len(c.logprobs) < n
    assert c.token_ids == whole.token_ids[: len(c.token_ids)]
    after = await engine.generate(PROMPT, greedy(2), "i2")  # serving again after the resume
    assert after[0].token_ids == whole.token_ids[:2]


@pytest.mark.skipif(not IN_CHILD, reason="vLLM's load_format dummy; the transformers engine always loads")
async def test_random_start_then_a_folder_scores_as_a_cold_start(engine, tiny_model_dir, generator_config_tree):
    """A collective run starts vLLM on random weights (nothing read from disk); a folder loaded
    afterwards (a snapshot, or a filesystem refit) goes through vLLM's disk loader and scores as
    an engine started cold on it (``engine`` here)."""
    tree = generator_config_tree(tiny_model_dir, run_id="random", redis_url=None, backend="vllm")
    tree["refit"] = {"transport": "collective"}
    random_start = build_engine(decode_tree(tree, RunConfig))
    await random_start.start()
    try:
        assert random_start.info.random_weights and random_start.info.extra["load_format"] == "dummy"
        params = greedy(6, top_logprobs=3)
        [before] = await random_start.generate(PROMPT, params, "random-0")
        await restore(engine, tiny_model_dir)
        [cold] = await engine.generate(PROMPT, params, "random-cold")
        assert before.logprobs != pytest.approx(cold.logprobs, abs=1e-3)
        await restore(random_start, tiny_model_dir)
        [after] = await random_start.generate(PROMPT, params, "random-1")
        assert after.token_ids == cold.token_ids
        assert after.logprobs == pytest.approx(cold.logprobs, abs=1e-5)
    finally:
        await random_start.aclose()

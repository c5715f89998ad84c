"""The Engine contract, run against every backend on two models: the transformers engine
in-process (integration); the vLLM engine when STREAMRL_VLLM_CONTRACT_CHILD=1, which
tests/e2e/test_generator_vllm.py sets for a child pytest process of its own (~30 s to start).

The models: the tiny dense Qwen3 (``tiny_model_dir``) and the tiny Qwen3.5-MoE
(``tiny_hybrid_moe_dir``: Gated DeltaNet linear attention beside gated full attention, routed
experts). The hybrid model runs the checks that depend on the model: prefix caching as the engine
settles it, seeded sampling (of a short and a long prompt), greedy logprobs against a
transformers forward pass, in-place refits from a folder and over a transfer group scored against
a cold start. The checks of the engine's own behaviour, whatever the model (text stops, the
sampler's nucleus logprobs, keep and interrupt pauses, vLLM's switch from random start weights to
its disk loader), run on the dense model only.

On vLLM the hybrid model runs as `services.generator.vllm_settings` settles it, the config leaving
dtype and prefix caching to the engine. On CPU that is bfloat16 (vLLM's CPU Gated DeltaNet
kernels run nothing else), so its logprobs are held to `LOGPROB_TOLERANCE["bfloat16"]` against
the float32 forward pass, while a refit is still compared with a cold start in the same dtype
(1e-5). And on CPU it runs without a prefix cache: vLLM caches a hybrid model's prefix only with
chunked prefill, under which a CPU engine must ignore per-request seeds, and same seed, same
samples is part of the contract; `test_prefix_caching_as_settled_for_the_model` asserts it, and
the refit tests cannot meet a stale prefix there. On GPUs it has vLLM's prefix cache, recurrent
states cached at block boundaries: the refit tests serve their long prompt (longer than a block,
checked) twice before the refit, so a state cached under the old weights and served after it
would fail them (as it did on CPU with prefix caching asked for and the reset left out).

Why a child process: once an in-process vLLM engine has shut down, the event loop it ran on keeps
registrations of vLLM's ZMQ sockets, and later Redis reads on that loop stall until their socket
timeout. The generator service is unaffected (it closes the engine last), but a test session that
shares one event loop across tests is not.
"""

import asyncio
import os
import time
from dataclasses import dataclass

import pytest

from services.generator.engine import Engine, GenerationParams, build_engine
from shared.config import decode_tree
from shared.run_config import RunConfig

IN_CHILD = os.environ.get("STREAMRL_VLLM_CONTRACT_CHILD") == "1"
PROMPT = [1, 355, 207, 567, 291, 229, 26, 2, 207, 1, 367, 207]
LONG_PROMPT = (PROMPT * 40)[:400]  # whole KV blocks (and recurrent-state blocks): the prefix cache holds them

# Largest |engine logprob - float32 transformers logprob| allowed on a greedy token, by the dtype
# the engine runs in (nats). float32: the same arithmetic in another order. bfloat16 (the hybrid
# model on vLLM on CPU) keeps 8 bits of mantissa, a relative rounding error of 2^-9 on every
# weight and activation: on the tiny Qwen3.5-MoE vLLM measured at most 0.004 from the float32
# pass on greedy tokens, of the model and of its copies noised at `REFIT_NOISE` (transformers'
# own bfloat16 pass is as far). 0.05 is ten times that, and a tenth of what the old weights are
# off on the new weights' tokens (0.37 and more; `test_pause_load_reset_resume` checks the gap).
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}
# Scale of the noise on a refit's new weights. A routed MoE turns bfloat16 rounding into jumps
# where two experts' router scores nearly tie (the token takes the other expert): on copies
# noised at 0.05, single tokens moved 0.3 to 1.7 nats from float32 in vLLM and in transformers'
# bfloat16 alike, at 0.02 up to 0.07, at 0.01 never more than 0.006.
REFIT_NOISE = 0.01
REFIT_PARAMS = GenerationParams(temperature=0.0, top_p=1.0, max_tokens=6, top_logprobs=3)


@dataclass(frozen=True)
class Case:
    backend: str
    model: str  # the session fixture that builds the model folder

    @property
    def hybrid(self) -> bool:
        return self.model == "tiny_hybrid_moe_dir"

    def tree(self, model_dir, config_tree, run_id: str) -> dict:
        """The run config of an engine of this case on ``model_dir`` (a cold start's too)."""
        tree = config_tree(model_dir, run_id=run_id, redis_url=None, backend=self.backend)
        if self.hybrid and self.backend == "vllm":
            v = tree["policy"]["generation"]["vllm_cfg"]
            v["dtype"] = "auto"  # bfloat16 on CPU, where float32 is refused
            del v["enable_prefix_caching"]  # what the engine settles for the model and platform
        return tree


MODELS = {"tiny_model_dir": "dense", "tiny_hybrid_moe_dir": "hybrid"}
CASES = (
    [pytest.param(Case("vllm", m), id=f"vllm-{name}") for m, name in MODELS.items()]
    if IN_CHILD
    else [
        pytest.param(Case("transformers", m), id=f"transformers-{name}", marks=pytest.mark.integration)
        for m, name in MODELS.items()
    ]
)


@pytest.fixture(scope="module", params=CASES)
def case(request) -> Case:
    return request.param


@pytest.fixture(scope="module")
def model_dir(case, request):
    return request.getfixturevalue(case.model)


@pytest.fixture(scope="module")
async def engine(case, model_dir, generator_config_tree):
    tree = case.tree(model_dir, generator_config_tree, "contract")
    # The engine also takes weights over a transfer group: a broadcast one here (the resharding
    # engine's refits into real engines: tests/integration/test_reshard_engines.py, the e2e run).
    tree["refit"] = {"transport": "collective", "collective": {"method": "broadcast"}}
    # Real weights at start (collective runs start vLLM on random ones: test_random_start_*).
    tree["policy"]["generation"].setdefault("vllm_cfg", {})["load_format"] = "auto"
    eng = build_engine(decode_tree(tree, RunConfig))
    await eng.start()
    yield eng
    await eng.aclose()


@pytest.fixture
def dense_only(case):
    if case.hybrid:
        pytest.skip("the engine's own behaviour, whatever the model: checked on the dense model")


def dtype_of(engine, case) -> str:
    return engine.info.extra["dtype"] if case.backend == "vllm" else "float32"


def greedy(max_tokens: int, **kw) -> GenerationParams:
    return GenerationParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, **kw)


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_is_an_engine_with_a_context_length(engine):
    assert isinstance(engine, Engine)
    assert engine.info.max_model_len == 1024 and not engine.errored


async def test_prefix_caching_as_settled_for_the_model(engine, case):
    """The dense model's config asks for prefix caching; the hybrid model's leaves it to the
    engine, which turns it off on CPU (seeds would go) and keeps vLLM's default, on, on GPUs. A
    reset answers whether there was a cache to reset."""
    if case.backend == "transformers":
        expected = False  # no prefix cache at all
    elif case.hybrid:
        from vllm.platforms import current_platform

        expected = not current_platform.is_cpu()
    else:
        expected = True
    assert engine.prefix_caching_enabled is expected
    if expected:  # refit tests' long prompt must span whole blocks, or a stale cache could not show
        assert len(LONG_PROMPT) > int(engine.info.extra["block_size"])
    await engine.pause("drain")
    assert await engine.reset_prefix_cache() is expected
    await engine.resume()


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
    long = await engine.generate(LONG_PROMPT, params, "c3")  # a prompt of several blocks, seeded
    assert [c.token_ids for c in await engine.generate(LONG_PROMPT, params, "c4")] == [c.token_ids for c in long]


async def test_stop_token_is_included_and_greedy_logprobs_are_raw(engine, case, model_dir, logprob_reference):
    [free] = await engine.generate(PROMPT, greedy(4), "g1")
    ref = logprob_reference(model_dir, PROMPT, free.token_ids, 1.0)
    assert max_diff(ref, free.logprobs) < LOGPROB_TOLERANCE[dtype_of(engine, case)]
    first = free.token_ids[0]
    [stopped] = await engine.generate(PROMPT, greedy(4, stop_token_ids=(first,)), "g2")
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


async def test_text_stop_ends_on_the_token_that_completes_it(engine, dense_only, tiny_tokenizer):
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


async def test_sampled_logprobs_are_the_trainers_nucleus_scoring(engine, dense_only, model_dir):
    """At several top_p < 1 and temperatures, the logprobs the engine reports for the tokens it
    sampled (vLLM: its own sampler's processed logprobs) are what the trainer computes for them
    from a transformers forward pass (`shared_torch.nucleus.sampled_logprobs`, as the loss scores
    them), within 1e-3; scored without the truncation they are not (the bias the nucleus scoring
    removes), so a trainer that dropped it would fail here."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared_torch.nucleus import sampled_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
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


@pytest.fixture(scope="module")
def new_weights(model_dir, perturbed_model, tmp_path_factory):
    """``model_dir`` with noise of scale `REFIT_NOISE`: what the refit tests load."""
    return perturbed_model(model_dir, tmp_path_factory.mktemp("contract-new"), scale=REFIT_NOISE, seed=21)


@pytest.fixture(scope="module")
async def cold_answer(case, new_weights, generator_config_tree):
    """What an engine of the case started cold on `new_weights` answers to `LONG_PROMPT` (greedy,
    with alternatives); one cold start serves both refit tests."""
    cold_engine = build_engine(decode_tree(case.tree(new_weights, generator_config_tree, "cold"), RunConfig))
    await cold_engine.start()
    try:
        [cold] = await cold_engine.generate(LONG_PROMPT, REFIT_PARAMS, "cold")
    finally:
        await cold_engine.aclose()
    return cold


async def test_pause_load_reset_resume(engine, case, model_dir, new_weights, logprob_reference):
    await engine.pause("drain")
    await engine.load_weights(str(new_weights))
    assert await engine.reset_prefix_cache() is engine.prefix_caching_enabled
    await engine.resume()
    [c] = await engine.generate(PROMPT, greedy(4), "w1")
    tolerance = LOGPROB_TOLERANCE[dtype_of(engine, case)]
    assert max_diff(logprob_reference(new_weights, PROMPT, c.token_ids, 1.0), c.logprobs) < tolerance
    # The old weights score these tokens far outside the tolerance: the check tells them apart.
    assert max_diff(logprob_reference(model_dir, PROMPT, c.token_ids, 1.0), c.logprobs) > 5 * tolerance
    await restore(engine, model_dir)


async def test_refit_matches_a_cold_start_on_the_new_weights(engine, model_dir, new_weights, cold_answer):
    """After pause -> load -> cache reset -> resume, a prompt whose KV blocks (and, for the hybrid
    model with a prefix cache, recurrent states) were cached under the old weights scores exactly
    as on an engine started cold on the new weights."""
    await cache_the_long_prompt(engine, "cold")
    await engine.pause("drain")
    await engine.load_weights(str(new_weights))
    assert await engine.reset_prefix_cache() is engine.prefix_caching_enabled
    await engine.resume()
    [warm] = await engine.generate(LONG_PROMPT, REFIT_PARAMS, "cold-2")
    assert_same_answer(warm, cold_answer)
    await restore(engine, model_dir)


async def cache_the_long_prompt(engine, request_id: str) -> None:
    """`LONG_PROMPT` served twice under the current weights: vLLM's attention layers cache their
    blocks the first time, a hybrid model's recurrent states (mamba cache mode ``align``) are
    sometimes cached at a block boundary only by a later request of the same prefix (measured:
    a 400-token prompt at block size 256 was served from the cache the third time). Then a
    missing reset would serve the whole prefix stale: on the tiny Qwen3.5-MoE on CPU with prefix
    caching asked for, skipping it moved a token and the logprobs by 0.22 nats."""
    for i in range(2):
        await engine.generate(LONG_PROMPT, REFIT_PARAMS, f"{request_id}-old-{i}")


def assert_same_answer(warm, cold) -> None:
    """``warm`` (what an engine answered after taking new weights in place) equals ``cold`` (an
    engine of the same backend and dtype started on them): tokens, logprobs, alternatives."""
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


async def test_collective_refit_matches_a_cold_start_on_the_new_weights(engine, model_dir, new_weights, cold_answer):
    """Weights received over a transfer group (vLLM's weight-transfer engine; gloo here), under the
    names a checkpoint stores them by (a trainer publishes those), score exactly as an engine
    started cold on the same weights, and both sides agree on the checksum."""
    import torch
    from safetensors.torch import load_file

    from services.trainer.weight_send import CollectiveSender, SendOrder, weight_source
    from shared.weights_format import safetensors_files
    from streamrl.redis_server import free_port

    class Policy:  # what a collective refit reads from a training backend
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

        def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
            return [(n, tuple(t.shape)) for n, t in self.tensors.items()]

        def weight_tensors(self):
            return iter(self.tensors.items())

    await cache_the_long_prompt(engine, "coll")
    stored = {n: t for f in safetensors_files(new_weights) for n, t in load_file(str(f)).items()}
    sender = CollectiveSender(weight_source(Policy(stored), torch.float32), rank=0)
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
    [warm] = await engine.generate(LONG_PROMPT, REFIT_PARAMS, "coll-2")
    assert_same_answer(warm, cold_answer)
    await restore(engine, model_dir)


async def test_keep_pause_holds_requests_until_resume(engine, dense_only):
    await engine.pause("keep")
    task = asyncio.create_task(engine.generate(PROMPT, greedy(3), "k1"))
    await asyncio.sleep(0.5)
    assert not task.done()
    await engine.resume()
    [c] = await asyncio.wait_for(task, 60)
    assert len(c.token_ids) == 3


async def test_interrupt_pause_ends_running_requests_with_their_tokens(engine, dense_only):
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
async def test_random_start_then_a_folder_scores_as_a_cold_start(
    engine, dense_only, case, model_dir, generator_config_tree
):
    """A collective run starts vLLM on random weights (nothing read from disk); a folder loaded
    afterwards (a snapshot, or a filesystem refit) goes through vLLM's disk loader and scores as
    an engine started cold on it (``engine`` here). The switch to the disk loader is the engine's,
    whatever the model; loading a folder in place into the hybrid model is
    `test_refit_matches_a_cold_start_on_the_new_weights`."""
    tree = case.tree(model_dir, generator_config_tree, "random")
    tree["refit"] = {"transport": "collective"}
    random_start = build_engine(decode_tree(tree, RunConfig))
    await random_start.start()
    try:
        assert random_start.info.random_weights and random_start.info.extra["load_format"] == "dummy"
        params = greedy(6, top_logprobs=3)
        [before] = await random_start.generate(PROMPT, params, "random-0")
        await restore(engine, model_dir)
        [cold] = await engine.generate(PROMPT, params, "random-cold")
        assert before.logprobs != pytest.approx(cold.logprobs, abs=1e-3)
        await restore(random_start, model_dir)
        [after] = await random_start.generate(PROMPT, params, "random-1")
        assert_same_answer(after, cold)
    finally:
        await random_start.aclose()


@pytest.mark.skipif(not IN_CHILD, reason="vLLM's CPU kernels")
async def test_a_dtype_the_cpu_kernels_cannot_run_fails_at_start(case, model_dir, generator_config_tree):
    """float32 asked for a model with Gated DeltaNet layers on CPU: the engine refuses at start,
    before any engine process, naming the key and the dtype that runs."""
    from vllm.platforms import current_platform

    from shared.config_error import ConfigError

    if not (case.hybrid and current_platform.is_cpu()):
        pytest.skip("only a Gated DeltaNet model on CPU is held to one dtype")
    tree = generator_config_tree(model_dir, run_id="float32", redis_url=None, backend="vllm")  # dtype float32
    with pytest.raises(ConfigError, match=r"policy\.generation\.vllm_cfg\.dtype: 'float32'.*bfloat16"):
        await build_engine(decode_tree(tree, RunConfig)).start()

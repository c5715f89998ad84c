"""With nucleus sampling (top_p < 1) the trainer scores sampled tokens under the distribution the
engine sampled them from: at equal weights ``token_mult_prob_error`` (mean exp|logp_gen - logp_train|)
is 1 within 1e-3. The transformers engine samples with vLLM's rule (the same helper as the
trainer); the real vLLM engine's sampler is checked against the trainer's scoring at four
(temperature, top_p) pairs by the engine contract
(test_generator_engine_contract.py::test_sampled_logprobs_are_the_trainers_nucleus_scoring, run
against vLLM by tests/e2e/test_generator_vllm.py) and by the end-to-end run (top_p 0.9). A training
step also reports the error against the untruncated logprobs (``token_mult_prob_error_untruncated``)."""

import numpy as np
import pytest
import torch

from services.generator.engine import GenerationParams, build_engine
from services.trainer.backends import build_backend
from services.trainer.backends.backend import Backend
from services.trainer.backends.micro_batch import sampled_logprobs_of
from services.trainer.batch import Row, StepBatch
from shared.config import decode_tree
from shared.run_config import RunConfig

pytestmark = pytest.mark.integration

PROMPT = [1, 355, 207, 567, 291, 229, 26, 2, 207, 1, 367, 207]
TEMPERATURE, TOP_P = 0.8, 0.9


def _mult_prob_error(backend: Backend, rows: list[Row], top_p: float = TOP_P) -> float:
    """Mean exp|logp_gen - logp_train| with the trainer's logprobs under ``top_p`` (the backend's
    own scoring at the configured top_p; the same logits under another nucleus otherwise)."""
    with torch.no_grad():
        if top_p == TOP_P:
            lp = backend.logprobs(rows).numpy()
        else:
            mb = backend.inputs(rows)
            lp = sampled_logprobs_of(backend.adapter.logits(backend.model, mb), mb, TEMPERATURE, top_p).numpy()
    errs = [np.exp(np.abs(lp[i] - r.gen_logprobs))[r.token_mask > 0] for i, r in enumerate(rows)]
    return float(np.concatenate(errs).mean())


async def test_trainer_and_engine_agree_under_nucleus_sampling(tiny_model_dir, generator_config_tree):
    tree = generator_config_tree(tiny_model_dir, run_id="nucleus", redis_url=None, backend="transformers")
    tree["policy"]["generation"].update({"temperature": TEMPERATURE, "top_p": TOP_P})
    tree["policy"]["precision"] = "float32"
    tree["data"] = {"train_path": "unused.jsonl"}
    cfg = decode_tree(tree, RunConfig)
    engine = build_engine(cfg)
    await engine.start()
    try:
        params = GenerationParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=24, n=8, seed=3)
        choices = await engine.generate(PROMPT, params, "nucleus")
    finally:
        await engine.aclose()
    rows = []
    for c in choices:
        n = len(PROMPT) + len(c.token_ids)
        mask = np.zeros(n, np.float32)
        mask[len(PROMPT) :] = 1.0
        gen = np.zeros(n, np.float32)
        gen[len(PROMPT) :] = c.logprobs
        rows.append(Row("t", "g", np.array(PROMPT + c.token_ids, np.int64), mask, gen, reward=0.0))
    tree.setdefault("run", {})["seed"] = 0
    tree.setdefault("trainer", {})["torch_threads"] = 1
    backend = build_backend(decode_tree(tree, RunConfig))
    assert abs(_mult_prob_error(backend, rows) - 1.0) < 1e-3
    # scoring under the untruncated distribution: the bias this test guards against
    biased = _mult_prob_error(backend, rows, top_p=1.0)
    assert biased > 1.0 + 1e-3
    # A training step at top_p 0.9 reports both: the error it trains with and the biased one.
    metrics = backend.train_step(StepBatch(rows))
    assert abs(metrics.token_mult_prob_error - 1.0) < 1e-3
    assert metrics.token_mult_prob_error_untruncated == pytest.approx(biased, rel=1e-4)

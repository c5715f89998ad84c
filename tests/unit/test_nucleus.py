"""vLLM's top-p rule, as the transformers engine samples with it and the trainer scores with it, and
the trainer's diagnostic of the bias it removes (the mismatch against untruncated logprobs)."""

import math

import numpy as np
import pytest
import torch

from shared_torch.nucleus import sampled_logprobs, top_p_mask

pytestmark = pytest.mark.unit


def test_the_nucleus_follows_vllms_ascending_rule():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # ascending cumulative mass: 0.05, 0.20, 0.50, 1.00; dropped where <= 1 - top_p
    kept = top_p_mask(logits, 0.8).isfinite().tolist()
    assert kept == [True, True, False, False]  # 0.20 <= 0.2 drops the third token too
    assert top_p_mask(logits, 0.9).isfinite().tolist() == [True, True, True, False]
    assert top_p_mask(logits, 1.0) is logits
    assert top_p_mask(logits, 0.01).isfinite().tolist() == [True, False, False, False]  # the top token stays


def test_a_sampled_token_stays_in_and_gradients_flow_to_the_kept_logits():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().requires_grad_()
    masked = top_p_mask(logits, 0.8, keep=torch.tensor([3]))
    assert masked.isfinite().tolist() == [[True, True, False, True]]
    lp = torch.log_softmax(masked, dim=-1)[0, 3]
    assert float(lp.detach()) == pytest.approx(math.log(0.05 / 0.85), rel=1e-5)
    lp.backward()
    assert logits.grad is not None and float(logits.grad[0, 2]) == 0.0 and float(logits.grad[0, 0]) != 0.0


def test_sampled_logprobs_truncate_and_report_the_untruncated_figures_on_request():
    logits = torch.tensor([[[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]]).log() * 0.8  # [1, 2, V]
    targets = torch.tensor([[1, 3]])
    lp, plain = sampled_logprobs(logits, targets, 0.8, 0.8, untruncated=True)
    # temperature 0.8 gives back the probabilities above; the nuclei are {0, 1} and {1, 2, 3}
    assert lp[0].tolist() == pytest.approx([math.log(0.3 / 0.8), math.log(0.4 / 0.9)], rel=1e-5)
    assert plain is not None and plain[0].tolist() == pytest.approx([math.log(0.3), math.log(0.4)], rel=1e-5)
    assert sampled_logprobs(logits, targets, 0.8, 0.8)[1] is None  # only on request
    full, none = sampled_logprobs(logits, targets, 0.8, 1.0, untruncated=True)
    assert none is None and full[0].tolist() == pytest.approx([math.log(0.3), math.log(0.4)], rel=1e-5)


def _tiny_backend(monkeypatch, top_p: float, *extra: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.trainer.backends import build_backend, hf_adapter
    from shared.config import load
    from shared.run_config import RunConfig

    def tiny(path, dtype):
        torch.manual_seed(0)
        spec = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, **spec)).to(dtype)

    monkeypatch.setattr(hf_adapter, "load_pretrained", tiny)
    overrides = ["policy.model_name=tiny", "data.train_path=t.jsonl", "policy.generation.temperature=0.8"]
    overrides += ["run.seed=0", "trainer.torch_threads=1"]
    cfg = load(RunConfig, None, [*overrides, f"policy.generation.top_p={top_p}", *extra], env={})
    return build_backend(cfg)


def _rows(backend):
    from services.trainer.batch import Row

    rng = np.random.default_rng(0)
    rows = []
    for i, n in enumerate((12, 9)):
        mask = np.zeros(n, np.float32)
        mask[4:] = 1.0
        rows.append(Row(f"t{i}", "g", rng.integers(1, 64, n).astype(np.int64), mask, np.zeros(n, np.float32), 1.0))
    return rows


def test_the_trainer_reports_the_mismatch_against_untruncated_logprobs_under_nucleus_sampling(monkeypatch):
    """top_p 0.9: the generator's logprobs are the truncated ones (as vLLM reports them), so the
    step's token_mult_prob_error is 1 while the untruncated figures show the bias the truncation
    removes: exactly what scoring at top_p 1 against the same logprobs gives."""
    from services.trainer.batch import StepBatch

    truncated, untruncated = _tiny_backend(monkeypatch, 0.9), _tiny_backend(monkeypatch, 1.0)
    rows = _rows(truncated)
    with torch.no_grad():
        gen = truncated.logprobs(rows)
        plain = untruncated.logprobs(rows)
    for i, r in enumerate(rows):
        r.gen_logprobs = (gen[i, : len(r.input_ids)].numpy() * r.token_mask).astype(np.float32)
    mask = truncated.inputs(rows).token_mask
    log_w = (plain - gen) * mask
    want_mult = float((torch.exp(log_w.abs()) * mask).sum() / mask.sum())
    want_kl = float(((torch.exp(log_w) - log_w - 1.0) * mask).sum() / mask.sum())
    assert want_mult > 1.01 and want_kl > 1e-4

    m = truncated.train_step(StepBatch(rows))
    assert m.token_mult_prob_error == pytest.approx(1.0, abs=1e-5)
    assert m.token_mult_prob_error_untruncated == pytest.approx(want_mult, rel=1e-5)
    assert m.gen_kl_error_untruncated == pytest.approx(want_kl, rel=1e-3)
    packed = _tiny_backend(monkeypatch, 0.9, "policy.sequence_packing.enabled=true")
    m_packed = packed.train_step(StepBatch(rows))
    assert m_packed.token_mult_prob_error_untruncated == pytest.approx(want_mult, rel=1e-5)
    m_full = untruncated.train_step(StepBatch(rows))  # top_p 1: no truncation, no diagnostic
    assert m_full.token_mult_prob_error == pytest.approx(want_mult, rel=1e-5)
    assert m_full.token_mult_prob_error_untruncated is None and m_full.gen_kl_error_untruncated is None


def test_the_refit_fidelity_figure_counts_only_rows_of_the_trainers_weights(monkeypatch):
    """gen_kl_error_fresh: rows the trainer's current weights generated score as the generator
    reported them (here exactly: 0), whatever the other rows' drift; None without such rows."""
    from services.trainer.batch import StepBatch

    backend = _tiny_backend(monkeypatch, 1.0)
    rows = _rows(backend)
    with torch.no_grad():
        gen = backend.logprobs(rows)
    for i, r in enumerate(rows):
        r.gen_logprobs = (gen[i, : len(r.input_ids)].numpy() * r.token_mask).astype(np.float32)
    rows[1].gen_logprobs = rows[1].gen_logprobs - 0.3 * rows[1].token_mask  # an older version's samples
    rows[0].fresh = True
    m = backend.train_step(StepBatch(rows))
    assert m.gen_kl_error is not None and m.gen_kl_error > 1e-3
    assert m.gen_kl_error_fresh is not None and m.gen_kl_error_fresh < 1e-6
    rows[0].fresh, rows[1].fresh = False, True
    drifted = _tiny_backend(monkeypatch, 1.0).train_step(StepBatch(rows))
    assert drifted.gen_kl_error_fresh is not None and drifted.gen_kl_error_fresh > 1e-2
    rows[1].fresh = False
    assert _tiny_backend(monkeypatch, 1.0).train_step(StepBatch(rows)).gen_kl_error_fresh is None

"""The torch training backend on the tiny model: normalisation after masking, and the
sequence-level logprob-error mask taking a row out of the update entirely."""

import numpy as np
import pytest
import torch

from services.trainer.backends.torch_backend import TorchBackend
from services.trainer.batch import Row, StepBatch
from shared.config import load
from shared.run_config import RunConfig

pytestmark = pytest.mark.integration


def _backend(model_dir, threshold=None) -> TorchBackend:
    cfg = load(
        RunConfig,
        None,
        [f"policy.model_name={model_dir}", "data.train_path=t.jsonl", "policy.optimizer.lr=1e-3"],
        env={},
    )
    return TorchBackend(cfg.policy, cfg.loss_fn, seed=0, threads=1, seq_logprob_error_threshold=threshold)


def _rows(backend: TorchBackend) -> tuple[Row, Row]:
    """A row whose generator logprobs equal the trainer's, and one that disagrees by 3 nats a token."""
    rng = np.random.default_rng(0)
    rows = []
    for i, shift in enumerate((0.0, 3.0)):
        ids = rng.integers(10, 800, size=14).astype(np.int64)
        tmask = np.zeros(14, np.float32)
        tmask[6:] = 1.0
        row = Row(f"t{i}", "g0", ids, tmask, np.zeros(14, np.float32), reward=1.0, advantage=1.0 - 2 * i)
        with torch.no_grad():
            lp = backend._token_logprobs(backend.model, backend._pad([row]))[0].numpy()
        row.gen_logprobs = ((lp - shift) * tmask).astype(np.float32)
        rows.append(row)
    return rows[0], rows[1]


def _params(backend):
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def test_a_row_over_the_threshold_is_taken_out_of_the_update(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("STREAMRL_LP_MASK_DEBUG", "1")
    masked = _backend(tiny_model_dir, threshold=2.0)
    good, bad = _rows(masked)
    metrics = masked.train_step(StepBatch([good, bad]))
    assert metrics["num_masked_seqs_by_logprob_error"] == 1.0
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(np.exp(3.0), rel=1e-3)
    assert metrics["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["masked_correct_pct"] == 100.0
    assert "[lp-mask-debug] masked(len,err,rew)=8,20.09,1 | kept_len mean=8.0" in capsys.readouterr().out

    alone = _backend(tiny_model_dir)
    good2, _ = _rows(alone)
    alone.train_step(StepBatch([good2]))
    # Same update as training on the kept row alone: masking also removed it from the normaliser.
    assert torch.allclose(_params(masked), _params(alone), atol=1e-6)

    unmasked = _backend(tiny_model_dir)
    good3, bad3 = _rows(unmasked)
    m = unmasked.train_step(StepBatch([good3, bad3]))
    assert "num_masked_seqs_by_logprob_error" not in m
    assert not torch.allclose(_params(unmasked), _params(alone), atol=1e-6)


def test_an_update_with_nothing_left_is_skipped(tiny_model_dir):
    backend = _backend(tiny_model_dir, threshold=1.5)
    _, bad = _rows(backend)
    before = _params(backend).clone()
    m = backend.train_step(StepBatch([bad]))
    assert m["num_masked_seqs_by_logprob_error"] == 1.0 and m["grad_norm"] == 0.0
    assert torch.equal(before, _params(backend))

"""Sequence-level logprob-mismatch measurement and masking (grpo.seq_logprob_error_threshold), the
opt-in debug line, and the training backend applying the mask (masked rows get no gradient)."""

import math

import numpy as np
import pytest
import torch

from services.trainer import mismatch
from services.trainer.mismatch import SeqRecord, apply_threshold, debug_line, seq_errors, summarize

pytestmark = pytest.mark.unit


def _errors(prev, gen, token_mask, sample_mask):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return seq_errors(t(prev), t(gen), t(token_mask), t(sample_mask))


def _records(err, n, rewards, old_mask, new_mask):
    return [
        SeqRecord(float(n[i]), float(err[i]), rewards[i], bool(old_mask[i] > 0 and new_mask[i] == 0))
        for i in range(len(rewards))
    ]


# Row errors: row 0 agrees exactly (1.0); row 1 has |d| = 1 on both tokens (e); row 2 has |d| = 0.5
# on one token and 0 on the other ((e^0.5 + 1) / 2 = 1.32).
PREV = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]
GEN = [[-1.0, -1.0], [-2.0, 0.0], [-1.5, -1.0]]
ONES = [[1.0, 1.0]] * 3


def test_no_threshold_only_computes_metrics():
    err, n = _errors(PREV, GEN, ONES, [1.0, 1.0, 1.0])
    assert err.tolist() == pytest.approx([1.0, math.e, (math.exp(0.5) + 1) / 2], rel=1e-6)
    smask = torch.ones(3)
    assert torch.equal(apply_threshold(err, smask, None), smask)
    out = summarize(_records(err, n, [1.0, 0.0, 1.0], smask, smask), None)
    assert out == pytest.approx(
        {
            "max_seq_mult_prob_error": math.e,
            "min_seq_mult_prob_error": 1.0,
            "mean_seq_mult_prob_error": float(err.mean()),
        }
    )


def test_masking_with_threshold_and_masked_correct_pct():
    err, n = _errors(PREV, GEN, ONES, [1.0, 1.0, 1.0])
    old = torch.ones(3)
    new = apply_threshold(err, old, 1.2)
    assert new.tolist() == [1.0, 0.0, 0.0]
    out = summarize(_records(err, n, [1.0, 1.0, 0.0], old, new), 1.2)
    assert out["num_masked_seqs_by_logprob_error"] == 2.0
    assert out["masked_correct_pct"] == pytest.approx(50.0)
    assert out["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.0)
    assert out["mean_seq_len_after_mask"] == 2.0


def test_no_sequences_masked_when_all_below_threshold():
    err, n = _errors(PREV, GEN, ONES, [1.0, 1.0, 1.0])
    new = apply_threshold(err, torch.ones(3), 3.0)
    assert new.tolist() == [1.0, 1.0, 1.0]
    assert summarize(_records(err, n, [1.0] * 3, torch.ones(3), new), 3.0)["num_masked_seqs_by_logprob_error"] == 0


def test_all_sequences_masked_gives_zero_after_mask_stats_and_a_debug_line():
    err, n = _errors([[-1.0, -1.0]] * 2, [[-3.0, -1.0], [0.0, -1.0]], [[1.0, 1.0]] * 2, [1.0, 1.0])
    new = apply_threshold(err, torch.ones(2), 1.01)
    assert new.tolist() == [0.0, 0.0]
    recs = _records(err, n, [1.0, 0.0], torch.ones(2), new)
    out = summarize(recs, 1.01)
    assert out["num_masked_seqs_by_logprob_error"] == 2.0
    assert out["max_seq_mult_prob_error_after_mask"] == 0.0 and out["mean_seq_len_after_mask"] == 0.0
    line = debug_line(recs, 1.01)  # the kept set is empty: no crash
    assert line.startswith("[lp-mask-debug] masked(len,err,rew)=2,")
    assert "kept_len mean=0.0 p90=0.0 max=0" in line and line.endswith("masked_len mean=2.0")


def test_respects_existing_sample_mask():
    err, n = _errors(PREV, GEN, ONES, [1.0, 0.0, 1.0])
    assert math.isnan(float(err[1]))  # a masked row has no valid token: no error, not "masked by error"
    old = torch.tensor([1.0, 0.0, 1.0])
    new = apply_threshold(err, old, 1.2)
    assert new.tolist() == [1.0, 0.0, 0.0]
    out = summarize(_records(err, n, [1.0, 1.0, 1.0], old, new), 1.2)
    assert out["num_masked_seqs_by_logprob_error"] == 1.0


def test_token_mask_is_respected():
    # The disagreeing token is not a loss token: the row's error is the agreeing token's, 1.0.
    err, _ = _errors([[-1.0, -1.0]], [[-5.0, -1.0]], [[0.0, 1.0]], [1.0])
    assert float(err[0]) == pytest.approx(1.0)


def test_fully_token_masked_sequences_are_excluded():
    err, n = _errors(PREV, GEN, [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]], [1.0, 1.0, 1.0])
    assert math.isnan(float(err[1])) and float(n[1]) == 0
    new = apply_threshold(err, torch.ones(3), 1.0)
    assert new[1] == 1.0  # not masked "by error": the loss has nothing from it anyway
    out = summarize(_records(err, n, [0.0] * 3, torch.ones(3), new), None)
    assert out["max_seq_mult_prob_error"] == pytest.approx((math.exp(0.5) + 1) / 2)  # row 1 left out


def test_empty_batch_returns_zero_metrics():
    assert summarize([], 2.0) == {
        "max_seq_mult_prob_error": 0.0,
        "mean_seq_mult_prob_error": 0.0,
        "min_seq_mult_prob_error": 0.0,
        "num_masked_seqs_by_logprob_error": 0.0,
        "masked_correct_pct": 0.0,
        "max_seq_mult_prob_error_after_mask": 0.0,
        "mean_seq_mult_prob_error_after_mask": 0.0,
        "min_seq_mult_prob_error_after_mask": 0.0,
        "mean_seq_len_after_mask": 0.0,
    }
    assert debug_line([], 2.0) is None


def test_threshold_boundary_values():
    err = torch.tensor([1.5, 1.5000001, 1.4999999])
    assert apply_threshold(err, torch.ones(3), 1.5).tolist() == [1.0, 0.0, 1.0]  # equal is kept


def test_debug_line_only_with_a_threshold_and_a_masked_row_and_lists_at_most_200(monkeypatch):
    recs = [SeqRecord(10.0, 1.0, 1.0, False)] * 9 + [SeqRecord(100.0, 1.0, 1.0, False)]
    assert debug_line(recs, None) is None and debug_line(recs, 2.0) is None
    masked = [SeqRecord(7.0, 3.456, 0.6, True)] * 250
    line = debug_line(recs + masked, 2.0)
    assert line.count(";") == 199 and line.split("=")[1].startswith("7,3.46,1;")
    p90 = np.percentile([10.0] * 9 + [100.0], 90)
    assert f"kept_len mean=19.0 p90={p90:.1f} max=100" in line
    monkeypatch.delenv("STREAMRL_LP_MASK_DEBUG", raising=False)
    monkeypatch.delenv("NRL_LP_MASK_DEBUG", raising=False)
    assert not mismatch.debug_enabled()
    monkeypatch.setenv("NRL_LP_MASK_DEBUG", "1")
    assert mismatch.debug_enabled()

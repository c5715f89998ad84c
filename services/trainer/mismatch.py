"""Sequence-level train/generation logprob mismatch: measure it per row, mask rows above a threshold.

For row i with loss mask m (token mask x sample mask; position t holds the logprob of token t
given the tokens before it, so the one-token shift is already applied) and
d_t = |logp_gen - logp_prev|::

    seq_err_i = sum_t m_t exp(d_t) / sum_t m_t          (1.0 = the engine and trainer agree)

Rows without a valid token get no error (NaN) and are left out of the statistics. With
``grpo.seq_logprob_error_threshold`` set, rows with ``seq_err > threshold`` are masked out of
the loss (the boundary is inclusive: equal is kept). Advantages were computed before this mask,
so masked rows still count in their group's baseline (as upstream does).

Per step (`summarize`): ``max/mean/min_seq_mult_prob_error`` always; with a threshold also
``num_masked_seqs_by_logprob_error``, ``masked_correct_pct`` (share of masked rows with reward 1)
and ``*_after_mask`` statistics over the kept rows (0 when nothing is kept). With
``STREAMRL_LP_MASK_DEBUG=1`` (or ``NRL_LP_MASK_DEBUG=1``) one parseable line per step lists the
masked rows, only when a threshold is set and something was masked; it works when every row is
masked (the kept set is empty)::

    [lp-mask-debug] masked(len,err,rew)=L1,E1,R1;... | kept_len mean=M p90=P max=X | masked_len mean=Q

With nucleus sampling (``policy.generation.top_p`` < 1) the trainer scores tokens under the
truncated distribution they were sampled from (`shared.nucleus.sampled_logprobs`). As a diagnostic
of the bias that removes, the step also reports ``token_mult_prob_error_untruncated`` and
``gen_kl_error_untruncated``: the same figures as the loss's ``token_mult_prob_error`` and
``gen_kl_error``, against the old policy's logprobs under the temperature-only softmax, from the
same forward pass (`untruncated_sums`, `untruncated_means`). They are absent at top_p 1.

Called by the training backend per micro-batch (`seq_errors`, `apply_threshold`,
`untruncated_sums`) and once per step (`summarize`, `debug_line`, `untruncated_means`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

DEBUG_ENV_VARS = ("STREAMRL_LP_MASK_DEBUG", "NRL_LP_MASK_DEBUG")
_DEBUG_MAX_ROWS = 200


def seq_errors(
    prev_lp: torch.Tensor, gen_lp: torch.Tensor, token_mask: torch.Tensor, sample_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_err [B] with NaN for rows without valid tokens, valid tokens per row [B]); no grad."""
    with torch.no_grad():
        mask = token_mask * sample_mask[:, None]
        d = (gen_lp - prev_lp).abs() * mask
        n = mask.sum(dim=1)
        err = (torch.exp(d) * mask).sum(dim=1) / n.clamp(min=1.0)
        return torch.where(n > 0, err, torch.full_like(err, float("nan"))), n


def apply_threshold(seq_err: torch.Tensor, sample_mask: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """The new sample mask: rows above the threshold masked, NaN rows and earlier masks unchanged."""
    if threshold is None:
        return sample_mask
    keep = ~(seq_err > threshold)  # NaN compares False: rows without tokens are not "masked by error"
    return sample_mask * keep.to(sample_mask.dtype)


def untruncated_sums(prev_untruncated: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over ``mask`` of exp|logp_gen - logp_old| and of the k3 estimate of KL(gen || old),
    with the old policy's logprobs scored without the top-p truncation; no grad."""
    with torch.no_grad():
        log_w = (prev_untruncated - gen_lp) * mask
        return {
            "token_mult_prob_error_untruncated_sum": float((torch.exp(log_w.abs()) * mask).sum()),
            "gen_kl_error_untruncated_sum": float(((torch.exp(log_w) - log_w - 1.0) * mask).sum()),
        }


def untruncated_means(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """The step's means of `untruncated_sums` over its ``tokens``; empty when none were measured."""
    names = ("token_mult_prob_error_untruncated", "gen_kl_error_untruncated")
    return {n: sums[f"{n}_sum"] / tokens for n in names if f"{n}_sum" in sums}


@dataclass
class SeqRecord:
    """One row's outcome, collected over a step's micro-batches."""

    length: float  # valid loss tokens (under the mask before thresholding)
    error: float  # NaN: no valid token
    reward: float
    masked: bool  # masked by the error threshold


def summarize(records: list[SeqRecord], threshold: float | None) -> dict[str, float]:
    """The step's sequence-error metrics (see the module docstring)."""
    valid = [r for r in records if not math.isnan(r.error)]
    out = _stats("seq_mult_prob_error", [r.error for r in valid])
    if threshold is None:
        return out
    masked = [r for r in valid if r.masked]
    kept = [r for r in valid if not r.masked]
    out["num_masked_seqs_by_logprob_error"] = float(len(masked))
    out["masked_correct_pct"] = 100.0 * sum(1 for r in masked if r.reward == 1.0) / len(masked) if masked else 0.0
    out.update({f"{k}_after_mask": v for k, v in _stats("seq_mult_prob_error", [r.error for r in kept]).items()})
    out["mean_seq_len_after_mask"] = float(np.mean([r.length for r in kept])) if kept else 0.0
    return out


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"max_{name}": 0.0, f"mean_{name}": 0.0, f"min_{name}": 0.0}
    return {f"max_{name}": max(values), f"mean_{name}": float(np.mean(values)), f"min_{name}": min(values)}


def debug_enabled() -> bool:
    return any(os.environ.get(v) == "1" for v in DEBUG_ENV_VARS)


def debug_line(records: list[SeqRecord], threshold: float | None) -> str | None:
    """The ``[lp-mask-debug]`` line, or None when no threshold is set or nothing was masked."""
    if threshold is None:
        return None
    masked = [r for r in records if r.masked]
    if not masked:
        return None
    kept = np.array([r.length for r in records if not r.masked and not math.isnan(r.error)], dtype=np.float64)
    listed = ";".join(f"{int(r.length)},{r.error:.2f},{r.reward:.0f}" for r in masked[:_DEBUG_MAX_ROWS])
    if kept.size:
        kept_stats = f"mean={kept.mean():.1f} p90={np.percentile(kept, 90):.1f} max={kept.max():.0f}"
    else:  # every row was masked: nothing to describe, and nothing to crash on
        kept_stats = "mean=0.0 p90=0.0 max=0"
    masked_mean = float(np.mean([r.length for r in masked]))
    return f"[lp-mask-debug] masked(len,err,rew)={listed} | kept_len {kept_stats} | masked_len mean={masked_mean:.1f}"

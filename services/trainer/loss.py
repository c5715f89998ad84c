"""Clipped policy-gradient loss with the train/generation importance-sampling correction.

Per token t (m_t = token mask x sample mask):
  r_t  = exp(logp_theta - logp_old)            PPO ratio; logp_old = the trainer's policy before
                                               this step's updates
  pg_t = max(-A r_t, -A clip(r_t, 1-eps_lo, 1+eps_hi))        (dual clip: min(pg_t, -A c) if A<0)
  w_t  = exp(logp_old - logp_gen)              detached; corrects both the engine/trainer numeric
                                               mismatch and the staleness of async samples.
                                               tis: clamp(w, min or 0, max); icepop: w=0 outside;
                                               seq-mask-tis: a sequence whose geometric-mean w is
                                               outside [min, max] gets w=0, kept ones raw w
  loss = sum_t m_t w_t pg_t [+ beta k3(ref || theta)] / (valid tokens of the whole step)
Token-level normalisation divides by the step's global valid-token count, so micro-batch losses
are summed, not averaged. With ``token_level_loss=False`` each sequence is averaged over its own
tokens and the step averages sequences instead.

Also reported (sums, turned into means by the caller): token_mult_prob_error
(mean exp|logp_gen - logp_old|, 1.0 is perfect), gen_kl_error (k3 estimate of KL(gen || old)),
sampling_importance_ratio (mean w), is_oob_ratio (tokens whose w hit a bound), clip fraction.
Pure torch; called by the training backend per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.run_config import LossSection


@dataclass
class LossNormalizer:
    """Global counts of the whole step (all micro-batches)."""

    valid_tokens: float
    valid_sequences: float


def importance_weights(
    prev_lp: torch.Tensor, gen_lp: torch.Tensor, cfg: LossSection, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, out-of-bounds mask); detached. ``mask`` ([B, T], the loss mask) is needed by
    seq-mask-tis, whose out-of-bounds mask marks every token of an out-of-bounds sequence."""
    with torch.no_grad():
        log_w = prev_lp - gen_lp
        w = torch.nan_to_num(torch.exp(log_w), nan=0.0, posinf=0.0, neginf=0.0)
        hi = cfg.truncated_importance_sampling_ratio
        lo = cfg.truncated_importance_sampling_ratio_min
        oob = torch.zeros_like(w, dtype=torch.bool)
        if hi is not None and cfg.truncated_importance_sampling_type == "seq-mask-tis":
            m = torch.ones_like(w) if mask is None else mask
            n = m.sum(dim=1)
            seq_w = torch.exp((torch.nan_to_num(log_w) * m).sum(dim=1) / n.clamp(min=1.0))
            bad = (n > 0) & ((seq_w > hi) | (seq_w < (lo if lo is not None else 0.0)))
            oob = bad[:, None].expand_as(w).clone()
            w = torch.where(oob, torch.zeros_like(w), w)
        elif hi is not None:
            oob = w > hi
            if lo is not None:
                oob = oob | (w < lo)
            if cfg.truncated_importance_sampling_type == "tis":
                w = w.clamp(min=lo if lo is not None else 0.0, max=hi)
            else:  # icepop: drop tokens whose weight is outside the bounds
                w = torch.where(oob, torch.zeros_like(w), w)
    return w, oob


def clipped_pg_loss(
    *,
    curr_lp: torch.Tensor,
    prev_lp: torch.Tensor,
    gen_lp: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    cfg: LossSection,
    norm: LossNormalizer,
    ref_lp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch ([B, T] tensors, advantages [B]) and metric sums."""
    mask = token_mask * sample_mask[:, None]
    adv = advantages[:, None].expand_as(curr_lp)
    ratio = torch.exp(curr_lp - prev_lp)
    clipped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    if cfg.ratio_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.ratio_clip_c), pg)
    if cfg.use_importance_sampling_correction:
        w, oob = importance_weights(prev_lp, gen_lp, cfg, mask)
        pg = pg * w
    else:
        w = torch.ones_like(pg)
        oob = torch.zeros_like(pg, dtype=torch.bool)
    per_token = pg
    kl_sum = 0.0
    if ref_lp is not None and cfg.reference_policy_kl_penalty > 0:
        log_r = (ref_lp - curr_lp).clamp(-20.0, 20.0)
        k3 = (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)
        per_token = per_token + cfg.reference_policy_kl_penalty * k3
        kl_sum = float((k3.detach() * mask).sum())
    if cfg.token_level_loss:
        loss = (per_token * mask).sum() / max(norm.valid_tokens, 1.0)
    else:
        seq_tokens = mask.sum(dim=1).clamp(min=1.0)
        loss = ((per_token * mask).sum(dim=1) / seq_tokens).sum() / max(norm.valid_sequences, 1.0)

    with torch.no_grad():
        diff = (gen_lp - prev_lp) * mask
        log_w = prev_lp - gen_lp
        metrics = {
            "tokens": float(mask.sum()),
            "token_mult_prob_error_sum": float((torch.exp(diff.abs()) * mask).sum()),
            "gen_kl_error_sum": float(((torch.exp(log_w) - log_w - 1.0) * mask).sum()),
            "sampling_importance_ratio_sum": float((w * mask).sum()),
            "is_oob_sum": float((oob.float() * mask).sum()),
            "clip_fraction_sum": float((((ratio - clipped).abs() > 1e-9).float() * mask).sum()),
            "kl_penalty_sum": kl_sum,
            "max_abs_logprob_diff": float(diff.abs().max()) if mask.any() else 0.0,
        }
    return loss, metrics

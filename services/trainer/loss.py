"""The policy loss: clipped policy gradient with the train/generation importance-sampling
correction, its ratio variants, and the KL to a reference policy.

Per token t (m_t = token mask x sample mask, A = the row's advantage, sg = stop-gradient):
  r_t  = exp(logp_theta - logp_old)            PPO ratio; logp_old = the trainer's policy before
                                               this step's updates
  pg_t = max(-A r_t, -A clip(r_t, 1-eps_lo, 1+eps_hi))        (dual clip: min(pg_t, -A c) if A<0)
  w_t  = exp(logp_old - logp_gen)              detached; corrects both the engine/trainer numeric
                                               mismatch and the staleness of async samples.
                                               tis: clamp(w, min or 0, max); icepop: w=0 outside;
                                               seq-mask-tis: a sequence whose geometric-mean w is
                                               outside [min, max] gets w=0, kept ones raw w
  kl_t = clamp(v_t k(log rho_t), +-out)        log rho_t = clamp(logp_ref - logp_theta, +-in);
                                               k1 = -log rho, k2 = (log rho)^2 / 2,
                                               k3 = rho - 1 - log rho;  v_t = exp(logp_theta -
                                               sg(logp_theta)) (1, keeping the score-function
                                               gradient) or exp(logp_theta - logp_gen) with
                                               use_on_policy_kl_approximation; sg(v_t) where the
                                               input clamp binds
  loss = sum_t m_t (w_t pg_t + beta kl_t) / (valid tokens of the whole step)
Ratio variants (``loss_fn.*``, at most one):
  sequence_level_importance_ratios (GSPO): r = exp(mean of the row's token log-ratios), one ratio
      per sequence, clipped per sequence; w = exp(sum of the row's token log-weights), also one
      per sequence. Needs the sequence-level reduction (``token_level_loss: false``).
  use_cispo (CISPO): pg_t = -A sg(clip(r_t)) logp_theta; the clipped ratio only weights the
      log-prob gradient (no PPO max), so a clipped token still gets a gradient.
  disable_ppo_ratio (REINFORCE/RLOO): pg_t = -A logp_theta.
  force_on_policy_ratio: r_t = exp(logp_theta - sg(logp_theta)) = 1 with its gradient, and
      sg(logp_theta) stands in for logp_old everywhere (one optimizer update per step).
With ``use_kl_in_reward`` beta is 0 here: the KL shapes the rewards before the advantages
(`services.trainer.kl_reward`). Token-level normalisation divides by the step's global valid-token
count, so micro-batch losses are summed, not averaged. With ``token_level_loss=False`` each
sequence is averaged over its own tokens and the step averages sequences instead.

Also reported (sums, turned into means by the caller): token_mult_prob_error
(mean exp|logp_gen - logp_old|, 1.0 is perfect), gen_kl_error (k3 estimate of KL(gen || old)),
sampling_importance_ratio (mean w), is_oob_ratio (tokens whose w hit a bound), clip fraction,
kl_penalty (mean kl_t). Pure torch; called by the training backend per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.sections.grpo import LossSection


@dataclass
class LossNormalizer:
    """Global counts of the whole step (all micro-batches)."""

    valid_tokens: float
    valid_sequences: float


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, cfg: LossSection, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' logprobs (Schulman's k1/k2/k3,
    ``cfg.reference_policy_kl_type``), with ``kl_input_clamp_value`` on the log-ratio and
    ``kl_output_clamp_value`` on the result. ``weights`` multiply it before the output clamp and
    lose their gradient where the input clamp binds."""
    log_r = ref_logprobs - logprobs
    if cfg.kl_input_clamp_value is not None:
        bound = cfg.kl_input_clamp_value
        clamped = log_r.clamp(-bound, bound)
        if weights is not None:
            weights = torch.where(clamped == log_r, weights, weights.detach())
        log_r = clamped
    if cfg.reference_policy_kl_type == "k1":
        kl = -log_r
    elif cfg.reference_policy_kl_type == "k2":
        kl = 0.5 * log_r.square()
    elif cfg.reference_policy_kl_type == "k3":
        kl = torch.exp(log_r) - 1.0 - log_r
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type must be k1, k2 or k3, not {cfg.reference_policy_kl_type!r}")
    if weights is not None:
        kl = weights * kl
    if cfg.kl_output_clamp_value is not None:
        kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the sum of ``x`` over each row's valid tokens."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum(dim=1, keepdim=True)


def policy_ratios(
    curr_lp: torch.Tensor, prev_lp: torch.Tensor, token_mask: torch.Tensor, cfg: LossSection
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, clipped ratio) per token [B, T], as the configured variant defines them."""
    if cfg.force_on_policy_ratio:
        ratio = torch.exp(curr_lp - curr_lp.detach())
        return ratio, ratio
    if cfg.disable_ppo_ratio:
        return curr_lp, curr_lp
    log_ratio = curr_lp - prev_lp
    if cfg.sequence_level_importance_ratios:
        n = token_mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        log_ratio = (_seq_sum(log_ratio, token_mask) / n).expand_as(curr_lp)
    ratio = torch.exp(log_ratio)
    return ratio, ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def actor_term(
    curr_lp: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, adv: torch.Tensor, cfg: LossSection
) -> torch.Tensor:
    """The per-token policy-gradient term before the importance weight."""
    if cfg.use_cispo:
        pg = -adv * clipped.detach() * curr_lp
    else:
        pg = torch.maximum(-adv * ratio, -adv * clipped)
    if cfg.ratio_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.ratio_clip_c), pg)
    return pg


def importance_weights(
    prev_lp: torch.Tensor, gen_lp: torch.Tensor, cfg: LossSection, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, out-of-bounds mask); detached. ``mask`` ([B, T], the loss mask) is needed by
    seq-mask-tis, whose out-of-bounds mask marks every token of an out-of-bounds sequence, and by
    sequence-level weights (GSPO), which give every token of a row the row's weight."""
    with torch.no_grad():
        m = torch.ones_like(prev_lp) if mask is None else mask
        log_w = prev_lp - gen_lp
        if cfg.sequence_level_importance_ratios:
            log_w = _seq_sum(log_w, m).expand_as(prev_lp)
        w = torch.nan_to_num(torch.exp(log_w), nan=0.0, posinf=0.0, neginf=0.0)
        hi = cfg.truncated_importance_sampling_ratio
        lo = cfg.truncated_importance_sampling_ratio_min
        oob = torch.zeros_like(w, dtype=torch.bool)
        if hi is not None and cfg.truncated_importance_sampling_type == "seq-mask-tis":
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


def reference_kl(curr_lp: torch.Tensor, ref_lp: torch.Tensor, gen_lp: torch.Tensor, cfg: LossSection) -> torch.Tensor:
    """The loss's per-token KL term kl_t (before beta), weighted as the module docstring says."""
    if cfg.use_on_policy_kl_approximation:
        v = torch.nan_to_num(torch.exp(curr_lp - gen_lp), nan=0.0, posinf=0.0, neginf=0.0)
    else:
        v = torch.exp(curr_lp - curr_lp.detach())
    return kl_estimate(curr_lp, ref_lp, cfg, weights=v)


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
    if cfg.force_on_policy_ratio:
        prev_lp = curr_lp.detach()  # the policy being trained is the old one, as with one update per step
    mask = token_mask * sample_mask[:, None]
    adv = advantages[:, None].expand_as(curr_lp)
    ratio, clipped = policy_ratios(curr_lp, prev_lp, token_mask, cfg)
    pg = actor_term(curr_lp, ratio, clipped, adv, cfg)
    if cfg.use_importance_sampling_correction:
        w, oob = importance_weights(prev_lp, gen_lp, cfg, mask)
        pg = pg * w
    else:
        w = torch.ones_like(pg)
        oob = torch.zeros_like(pg, dtype=torch.bool)
    per_token = pg
    kl_sum = 0.0
    beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
    if ref_lp is not None and beta > 0:
        kl = reference_kl(curr_lp, ref_lp, gen_lp, cfg)
        per_token = per_token + beta * kl
        kl_sum = float((kl.detach() * mask).sum())
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
            **divergence_sums(curr_lp.detach(), prev_lp, gen_lp, mask),
            **ratio_sums(ratio.detach(), clipped.detach(), mask),
        }
    return loss, metrics


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimate of KL(q || p) from samples of q, given log r = log p - log q."""
    return torch.exp(log_r) - log_r - 1.0


def divergence_sums(
    curr_lp: torch.Tensor, prev_lp: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """NeMo-RL's other trainer/generator divergences, summed over ``mask``'s tokens (the step
    divides by its tokens), all from the tokens the generator sampled:

    * ``policy_kl_error``: KL(P_train || P_gen), the reverse of ``gen_kl_error`` (k3 with the log
      ratio turned round);
    * ``js_divergence_error``: the Jensen-Shannon divergence, half of each side's k3 KL to the
      mixture M = (P_train + P_gen) / 2;
    * ``approx_entropy``: the current policy's entropy, importance-weighted to the generator's
      samples (-exp(logp_curr - logp_gen) logp_curr)."""
    log_mix = torch.logaddexp(prev_lp, gen_lp) - math.log(2.0)
    js = 0.5 * _k3(log_mix - prev_lp) + 0.5 * _k3(log_mix - gen_lp)
    entropy = -torch.exp(curr_lp - gen_lp) * curr_lp
    return {
        "policy_kl_error_sum": float((_k3(gen_lp - prev_lp) * mask).sum()),
        "js_divergence_error_sum": float((js * mask).sum()),
        "approx_entropy_sum": float((entropy * mask).sum()),
    }


def ratio_sums(ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The policy ratio's sum over ``mask``'s tokens (``probs_ratio``), the clipped ratio's
    (``probs_ratio_clamped``), and their extremes; no extreme without a token."""
    sums = {"probs_ratio_sum": float((ratio * mask).sum()), "probs_ratio_clamped_sum": float((clipped * mask).sum())}
    if mask.any():
        kept = ratio[mask > 0]
        sums["max_probs_ratio"] = float(kept.max())
        sums["min_probs_ratio"] = float(kept.min())
    return sums

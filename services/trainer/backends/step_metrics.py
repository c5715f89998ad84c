"""A step's figures: what its updates and micro-batches add up (`StepTotals`), made global over
the ranks (`global_totals`), and the `LearnerMetrics` made of them (`learner_metrics`: losses,
gradient norms, token-level mismatch and clipping means over the step's valid tokens, the KL to
the reference, sequence-level logprob errors, micro-batch token efficiency). Plain functions of
the step runner (`services.trainer.backends.step`), called by the backend once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.trainer import mismatch
from services.trainer.backends.layout import Layout
from shared.records import LearnerMetrics
from shared.sections.policy import SequencePackingSection


@dataclass
class StepTotals:
    """What a step's updates and micro-batches add up."""

    sums: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # of the updates applied
    skipped_updates: int = 0  # non-finite gradient norm (the same on every rank)
    records: list[mismatch.SeqRecord] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)  # row lengths of each micro-batch run

    def add(self, sums: dict[str, float]) -> None:
        """Add a micro-batch's sums (``max_*`` figures keep the largest, ``min_*`` the smallest)."""
        for k, v in sums.items():
            if k.startswith("max_"):
                self.sums[k] = max(self.sums.get(k, v), v)
            elif k.startswith("min_"):
                self.sums[k] = min(self.sums.get(k, v), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v


def global_totals(acc: StepTotals, layout: Layout) -> StepTotals:
    """The step's totals over its data ranks (losses and norms are global already), as the last
    stage scored them, on every rank."""
    if layout.data.sharded:
        out = StepTotals(losses=acc.losses, grad_norms=acc.grad_norms, skipped_updates=acc.skipped_updates)
        for sums, records, shapes in layout.data.gather((acc.sums, acc.records, acc.shapes)):
            out.add(sums)
            out.records += records
            out.shapes += shapes
        acc = out
    return layout.from_last_stage(acc)


def kl_penalty(sums: dict[str, float], *, reference: bool, in_reward: bool) -> float | None:
    """The step's mean per-token KL to the reference (None without one): the loss term's, or with
    ``loss_fn.use_kl_in_reward`` the one that shaped the rewards."""
    if not reference:
        return None
    if in_reward:
        return sums.get("reward_kl_sum", 0.0) / max(sums.get("reward_kl_tokens", 0.0), 1.0)
    return sums.get("kl_penalty_sum", 0.0) / max(sums.get("tokens", 0.0), 1.0)


def token_efficiency(shapes: list[list[int]], packing_cfg: SequencePackingSection) -> float:
    """Real tokens / tokens computed: packs against their budget, or padding to the longest row."""
    real = sum(sum(s) for s in shapes)
    if packing_cfg.enabled:
        computed = sum(max(packing_cfg.train_mb_tokens, sum(s)) for s in shapes)
    else:
        computed = sum(len(s) * max(s) for s in shapes)
    return real / computed if computed else 1.0


def learner_metrics(
    acc: StepTotals,
    *,
    num_updates: int,
    lr: float,
    train_time_s: float,
    kl: float | None,
    seq_error_threshold: float | None,
    packing_cfg: SequencePackingSection,
) -> LearnerMetrics:
    """The step's `LearnerMetrics` from its global totals."""
    sums = acc.sums
    tokens = max(sums.get("tokens", 0.0), 1.0)
    seq = mismatch.summarize(acc.records, seq_error_threshold)
    masked = seq.pop("num_masked_seqs_by_logprob_error", None)
    return LearnerMetrics(
        loss=float(np.mean(acc.losses)) if acc.losses else 0.0,  # of the updates applied
        grad_norm=float(np.mean(acc.grad_norms)) if acc.grad_norms else 0.0,
        num_updates=num_updates,
        num_skipped_updates=acc.skipped_updates or None,
        train_tokens=int(sums.get("tokens", 0.0)),
        lr=lr,
        train_time_s=train_time_s,
        token_mult_prob_error=sums.get("token_mult_prob_error_sum", 0.0) / tokens,
        gen_kl_error=sums.get("gen_kl_error_sum", 0.0) / tokens,
        gen_kl_error_fresh=(
            sums["gen_kl_error_fresh_sum"] / sums["fresh_tokens"] if sums.get("fresh_tokens") else None
        ),
        sampling_importance_ratio=sums.get("sampling_importance_ratio_sum", 0.0) / tokens,
        is_oob_ratio=sums.get("is_oob_sum", 0.0) / tokens,
        clip_fraction=sums.get("clip_fraction_sum", 0.0) / tokens,
        kl_penalty=kl,
        max_abs_logprob_diff=sums.get("max_abs_logprob_diff", 0.0),
        policy_kl_error=sums.get("policy_kl_error_sum", 0.0) / tokens,
        js_divergence_error=sums.get("js_divergence_error_sum", 0.0) / tokens,
        approx_entropy=sums.get("approx_entropy_sum", 0.0) / tokens,
        probs_ratio=sums.get("probs_ratio_sum", 0.0) / tokens,
        probs_ratio_clamped=sums.get("probs_ratio_clamped_sum", 0.0) / tokens,
        probs_ratio_min=sums.get("min_probs_ratio"),
        probs_ratio_max=sums.get("max_probs_ratio"),
        num_masked_seqs_by_logprob_error=None if masked is None else int(masked),
        micro_batch_token_efficiency=token_efficiency(acc.shapes, packing_cfg),
        **seq,
        **mismatch.untruncated_means(sums, tokens),
    )

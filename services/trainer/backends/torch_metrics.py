"""The torch backend's step figures: what a step's updates and micro-batches add up
(`StepTotals`), summed over the ranks, and the `LearnerMetrics` made of them (losses, gradient
norms, token-level mismatch and clipping means over the step's valid tokens, the KL to the
reference, sequence-level logprob errors, micro-batch token efficiency). Mixed into
`services.trainer.backends.torch_backend.TorchBackend`, which owns the attributes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.trainer import mismatch
from services.trainer.ranks import Ranks
from shared.records import LearnerMetrics
from shared.sections.grpo import LossSection
from shared.sections.policy import PolicySection


@dataclass
class StepTotals:
    """What a step's updates and micro-batches add up."""

    sums: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    records: list[mismatch.SeqRecord] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)  # row lengths of each micro-batch run


class TorchStepMetrics:
    data_ranks: Ranks
    policy: PolicySection
    loss_cfg: LossSection
    seq_error_threshold: float | None
    ref_model: Any
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler

    def _kl_penalty(self, sums: dict[str, float]) -> float | None:
        """The step's mean per-token KL to the reference (None without one): the loss term's, or
        with ``use_kl_in_reward`` the one that shaped the rewards."""
        if self.ref_model is None:
            return None
        if self.loss_cfg.use_kl_in_reward:
            return sums.get("reward_kl_sum", 0.0) / max(sums.get("reward_kl_tokens", 0.0), 1.0)
        return sums.get("kl_penalty_sum", 0.0) / max(sums.get("tokens", 0.0), 1.0)

    def _global_totals(self, acc: StepTotals) -> StepTotals:
        """The step's totals over every rank (losses and norms are global already)."""
        if not self.data_ranks.sharded:
            return acc
        out = StepTotals(losses=acc.losses, grad_norms=acc.grad_norms)
        for sums, records, shapes in self.data_ranks.gather((acc.sums, acc.records, acc.shapes)):
            for k, v in sums.items():
                out.sums[k] = max(out.sums.get(k, 0.0), v) if k.startswith("max_") else out.sums.get(k, 0.0) + v
            out.records += records
            out.shapes += shapes
        return out

    def _step_metrics(self, acc: StepTotals, num_updates: int, train_time_s: float) -> LearnerMetrics:
        sums = acc.sums
        tokens = max(sums.get("tokens", 0.0), 1.0)
        seq = mismatch.summarize(acc.records, self.seq_error_threshold)
        masked = seq.pop("num_masked_seqs_by_logprob_error", None)
        return LearnerMetrics(
            loss=float(np.mean(acc.losses)),
            grad_norm=float(np.mean(acc.grad_norms)),
            num_updates=num_updates,
            train_tokens=int(sums.get("tokens", 0.0)),
            lr=self._lr(),
            train_time_s=train_time_s,
            token_mult_prob_error=sums.get("token_mult_prob_error_sum", 0.0) / tokens,
            gen_kl_error=sums.get("gen_kl_error_sum", 0.0) / tokens,
            gen_kl_error_fresh=(
                sums["gen_kl_error_fresh_sum"] / sums["fresh_tokens"] if sums.get("fresh_tokens") else None
            ),
            sampling_importance_ratio=sums.get("sampling_importance_ratio_sum", 0.0) / tokens,
            is_oob_ratio=sums.get("is_oob_sum", 0.0) / tokens,
            clip_fraction=sums.get("clip_fraction_sum", 0.0) / tokens,
            kl_penalty=self._kl_penalty(sums),
            max_abs_logprob_diff=sums.get("max_abs_logprob_diff", 0.0),
            num_masked_seqs_by_logprob_error=None if masked is None else int(masked),
            micro_batch_token_efficiency=self._token_efficiency(acc.shapes),
            **seq,
            **mismatch.untruncated_means(sums, tokens),
        )

    def _lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _token_efficiency(self, shapes: list[list[int]]) -> float:
        """Real tokens / tokens computed: packs against their budget, or padding to the longest row."""
        real = sum(sum(s) for s in shapes)
        sp = self.policy.sequence_packing
        if sp.enabled:
            computed = sum(max(sp.train_mb_tokens, sum(s)) for s in shapes)
        else:
            computed = sum(len(s) * max(s) for s in shapes)
        return real / computed if computed else 1.0

"""``loss_fn.use_kl_in_reward`` in the torch backend: before a step's updates, the KL to the
reference policy summed over each rollout's loss tokens, gathered over the ranks, shapes the
rewards, and every row trains on the advantages of the shaped rewards
(`services.trainer.kl_reward`). Mixed into `services.trainer.backends.torch_backend.TorchBackend`,
which owns the attributes and the forward passes."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from services.trainer import kl_reward
from services.trainer.backends.torch_metrics import StepTotals
from services.trainer.batch import Row
from services.trainer.loss import kl_estimate
from services.trainer.ranks import Ranks
from services.trainer.step_plan import RankShare
from shared.sections.grpo import GrpoSection, LossSection
from shared.sections.policy import PolicySection


class KLRewardShaping:
    data_ranks: Ranks
    policy: PolicySection
    loss_cfg: LossSection
    grpo: GrpoSection
    model: torch.nn.Module
    ref_model: Any

    if TYPE_CHECKING:  # the backend's micro-batches and forward passes

        def _rows_logprobs(self, model: torch.nn.Module, rows: list[Row], filler: Row) -> dict[str, torch.Tensor]: ...

    def _shape_rewards(self, share: RankShare, acc: StepTotals) -> RankShare:
        """``loss_fn.use_kl_in_reward``: the share with its rows' advantages recomputed from the
        whole step's KL-shaped rewards (`services.trainer.kl_reward`)."""
        assert share.rollouts, "plan_step(..., reward_kl=True) gives every share the step's rollouts"
        mine, total, tokens = self._sequence_kl(share.rows + share.baseline_rows, share.filler)
        acc.sums["reward_kl_sum"], acc.sums["reward_kl_tokens"] = total, tokens
        g = self.grpo
        adv = kl_reward.shaped_advantages(
            share.rollouts,
            kl_reward.merge_sums(self.data_ranks.gather(mine)),
            self.loss_cfg.reference_policy_kl_penalty,
            group_size=g.num_generations_per_prompt,
            leave_one_out=g.use_leave_one_out_baseline,
            normalize=g.normalize_rewards,
        )
        return replace(share, updates=[[replace(r, advantage=adv[r.task_id]) for r in u] for u in share.updates])

    def _sequence_kl(self, rows: list[Row], filler: Row) -> tuple[dict[str, float], float, float]:
        """The KL estimate to the reference summed over each rollout's loss tokens of ``rows`` (task
        id -> sum), under the policy before this step's updates; and its token sum and count."""
        assert self.ref_model is not None
        return self._kl_sums(
            rows, self._rows_logprobs(self.model, rows, filler), self._rows_logprobs(self.ref_model, rows, filler)
        )

    def _kl_sums(
        self, rows: list[Row], lp: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
    ) -> tuple[dict[str, float], float, float]:
        """`_sequence_kl` from each row's logprobs under the policy and the reference."""
        sums: dict[str, float] = {}
        total = tokens = 0.0
        for r in rows:
            mask = torch.from_numpy(r.token_mask).to(lp[r.key].device)
            kl = float((kl_estimate(lp[r.key], ref[r.key], self.loss_cfg) * mask).sum())
            sums[r.task_id] = sums.get(r.task_id, 0.0) + kl
            total += kl
            tokens += float(mask.sum())
        return sums, total, tokens

"""``loss_fn.use_kl_in_reward``: before a step's updates, the KL to the reference policy summed
over each rollout's loss tokens, gathered over the ranks, shapes the rewards, and every row
trains on the advantages of the shaped rewards (`services.trainer.kl_reward`). Plain functions of
the step runner; the backend scores the rows under both policies and calls `shaped_share`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.trainer import kl_reward
from services.trainer.backends.layout import Layout
from services.trainer.backends.step_metrics import StepTotals
from services.trainer.batch import Row
from services.trainer.loss import kl_estimate
from services.trainer.step_plan import RankShare
from shared.sections.grpo import GrpoSection, LossSection

# each rollout's KL sum (task id -> sum), and the sum and token count over all of them
KLSums = tuple[dict[str, float], float, float]


def kl_sums(
    rows: list[Row], lp: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], loss_cfg: LossSection
) -> KLSums:
    """The KL estimate to the reference summed over each rollout's loss tokens of ``rows``, from
    each row's logprobs under the policy (``lp``) and the reference (``ref``), by row key."""
    sums: dict[str, float] = {}
    total = tokens = 0.0
    for r in rows:
        mask = torch.from_numpy(r.token_mask).to(lp[r.key].device)
        kl = float((kl_estimate(lp[r.key], ref[r.key], loss_cfg) * mask).sum())
        sums[r.task_id] = sums.get(r.task_id, 0.0) + kl
        total += kl
        tokens += float(mask.sum())
    return sums, total, tokens


def shaped_share(
    share: RankShare, mine: KLSums, layout: Layout, loss_cfg: LossSection, grpo: GrpoSection, acc: StepTotals
) -> RankShare:
    """The share with its rows' advantages recomputed from the whole step's KL-shaped rewards;
    ``mine``: this rank's `kl_sums` of its rows and baseline rows."""
    assert share.rollouts, "plan_step(..., reward_kl=True) gives every share the step's rollouts"
    per_rollout, total, tokens = mine
    acc.sums["reward_kl_sum"], acc.sums["reward_kl_tokens"] = total, tokens
    adv = kl_reward.shaped_advantages(
        share.rollouts,
        kl_reward.merge_sums(layout.data.gather(per_rollout)),
        loss_cfg.reference_policy_kl_penalty,
        group_size=grpo.num_generations_per_prompt,
        leave_one_out=grpo.use_leave_one_out_baseline,
        normalize=grpo.normalize_rewards,
    )
    return replace(share, updates=[[replace(r, advantage=adv[r.task_id]) for r in u] for u in share.updates])

"""The KL to the reference policy as a reward penalty (``loss_fn.use_kl_in_reward``): each
rollout's reward loses beta x its KL, and the step's group advantages are recomputed from the
shaped rewards; the loss then has no KL term.

Why in the learner: the reference logprobs exist only where the reference model lives, on the
trainer's ranks, while the control plane builds the batch and its advantages from the rewards
before the learner sees it. So the step plan (`services.trainer.step_plan.plan_step`) gives each
rank, besides its rows to train, its part of the rows that are out of the loss but still count in
a baseline (env-flagged, prefix-break, overlong-filtered rows), and the table of every rollout of
the step (`Rollout`). Before the step's updates the backend scores all these rows under the policy
as it is before the step and under the reference, sums the per-token estimate
(`services.trainer.loss.kl_estimate`: the loss's estimator and clamps) over each rollout's loss
tokens (a rollout split at prefix breaks: over all its rows), gathers the sums from every rank,
and `shaped_advantages` recomputes the advantages from r_i - beta KL_i with the control plane's
estimator (`services.trainer.advantages.batch_advantages`, grpo's leave-one-out and normalisation
settings). Placeholders keep advantage 0 and stay out of the baselines; rows without loss tokens
have KL 0. The step record's batch figures (advantages, rewards) are those before the penalty;
the learner reports the mean per-token KL as ``kl_penalty``.

NeMo-RL applies this option only in its Reinforce++ estimator (a per-token KL subtracted from the
token advantages before a global whitening). Here it serves the GRPO estimator as a per-sequence
reward penalty, the usual KL-shaped reward: sum_t kl_t estimates KL(pi || ref) of the whole
sequence. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.trainer.advantages import batch_advantages
from services.trainer.batch import Row


@dataclass(frozen=True)
class Rollout:
    """A rollout's place in its group's baseline."""

    task_id: str
    group_id: str
    reward: float  # the reward the batch builder computed the advantages from (overlong penalty included)
    placeholder: bool


def rollouts_of(rows: list[Row]) -> list[Rollout]:
    """One entry per rollout, in batch order: a rollout's first row (the rows after it with the
    same task id are its prefix-break segments, which share its reward and advantage)."""
    seen: set[str] = set()
    out = []
    for r in rows:
        if r.task_id not in seen:
            seen.add(r.task_id)
            out.append(Rollout(r.task_id, r.group_id, r.shaped_reward, r.placeholder))
    return out


def merge_sums(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Per-rollout KL sums from every rank (a rollout's rows may be on different ranks)."""
    out: dict[str, float] = {}
    for part in parts:
        for task_id, value in part.items():
            out[task_id] = out.get(task_id, 0.0) + value
    return out


def shaped_advantages(
    rollouts: list[Rollout],
    seq_kl: dict[str, float],
    beta: float,
    *,
    group_size: int,
    leave_one_out: bool,
    normalize: bool,
) -> dict[str, float]:
    """Each rollout's advantage (by task id) from its reward minus ``beta`` x its summed KL."""
    adv = batch_advantages(
        [r.group_id for r in rollouts],
        [r.reward - beta * seq_kl.get(r.task_id, 0.0) for r in rollouts],
        group_size=group_size,
        leave_one_out=leave_one_out,
        normalize=normalize,
        is_placeholder=[r.placeholder for r in rollouts],
    )
    return {r.task_id: float(a) for r, a in zip(rollouts, adv, strict=True)}

"""How a step's rows become optimizer updates, and each update's rows the ranks' shares; and the
learning-rate schedule over those updates.

`plan_step` is computed once per step by whoever drives the learner (rank 0 of many, or the one
rank), before any forward pass; `RankShare` is what each rank then trains. Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.trainer.batch import Row, StepBatch
from services.trainer.kl_reward import Rollout, rollouts_of
from shared.sections.policy import OptimizerSection


def lr_schedule(opt: OptimizerSection, total_updates: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate after ``n`` updates: warm-up, then constant/linear/cosine
    decay to ``min_lr_ratio`` at ``total_updates``."""

    def factor(n: int) -> float:
        if opt.warmup_steps and n < opt.warmup_steps:
            return (n + 1) / opt.warmup_steps
        if opt.scheduler == "constant" or total_updates <= opt.warmup_steps:
            return 1.0
        progress = min(1.0, (n - opt.warmup_steps) / max(1, total_updates - opt.warmup_steps))
        decay = 1.0 - progress if opt.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * decay

    return factor


@dataclass
class RankShare:
    """One rank's part of a step: its rows of each optimizer update (the same number of updates on
    every rank), and a row it can run masked when it has fewer micro-batches than another rank."""

    updates: list[list[Row]]
    filler: Row
    # Only with loss_fn.use_kl_in_reward (`services.trainer.kl_reward`): this rank's part of the
    # rows out of the loss that still count in a baseline, and every rollout of the step.
    baseline_rows: list[Row] = field(default_factory=list)
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        return [r for u in self.updates for r in u]


def plan_step(
    batch: StepBatch, world_size: int, train_global_batch_size: int | None, *, reward_kl: bool = False
) -> list[RankShare]:
    """Split a step's trainable rows into optimizer updates (``train_global_batch_size`` rows of the
    whole batch each), and each update's rows across ``world_size`` ranks, balanced by tokens
    (longest first, each to the rank with the fewest tokens so far). Every rank's rows keep the
    one-rank order (shortest first), which keeps padding small. Empty when nothing is trainable.
    ``reward_kl`` (``loss_fn.use_kl_in_reward``) adds what the KL reward penalty needs."""
    rows = sorted(batch.trainable, key=lambda r: len(r.input_ids))
    if not rows:
        return []
    global_bs = train_global_batch_size or len(batch.rows)
    num_updates = max(1, math.ceil(len(batch.rows) / global_bs))
    per_update = math.ceil(len(rows) / num_updates)
    order = {r.key: i for i, r in enumerate(rows)}
    filler = replace(rows[0], sample_mask=0.0, segments=[])
    shares = [RankShare(updates=[], filler=filler) for _ in range(world_size)]
    for u in range(num_updates):
        parts: list[list[Row]] = [[] for _ in range(world_size)]
        tokens = [0] * world_size
        for r in sorted(rows[u * per_update : (u + 1) * per_update], key=lambda r: -len(r.input_ids)):
            k = tokens.index(min(tokens))
            parts[k].append(r)
            tokens[k] += len(r.input_ids)
        for share, part in zip(shares, parts, strict=True):
            share.updates.append(sorted(part, key=lambda r: order[r.key]))
    if reward_kl:
        _add_baselines(batch, shares)
    return shares


def _add_baselines(batch: StepBatch, shares: list[RankShare]) -> None:
    """Every share gets the step's rollouts, and the rows with loss tokens that are out of the loss
    but count in a baseline are spread over the ranks by tokens."""
    trainable = {id(r) for r in batch.trainable}
    extra = [r for r in batch.rows if id(r) not in trainable and not r.placeholder and r.token_mask.sum() > 0]
    tokens = [sum(len(r.input_ids) for r in s.rows) for s in shares]
    for r in sorted(extra, key=lambda r: -len(r.input_ids)):
        k = tokens.index(min(tokens))
        shares[k].baseline_rows.append(r)
        tokens[k] += len(r.input_ids)
    rollouts = rollouts_of(batch.rows)
    for share in shares:
        share.rollouts = rollouts

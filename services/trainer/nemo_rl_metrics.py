"""A step's figures under NeMo-RL's names (`shared.records.NemoRLMetrics`), so that dashboards
built on NeMo-RL's logs carry over to a streamrl run.

    timing/train/*   the step's phases, under NeMo-RL's timer names
    performance/*    throughputs, by NeMo-RL's formulas
    train/*          buffer size, trajectory age, advantages, valid samples, per-rollout aggregates

Most are figures the record already has under streamrl's names (``total_step_time`` is
``timing.step_s``, ``avg_trajectory_age`` is ``staleness.mean``, ``weight_sync`` is
``refit.total_s``); the per-token advantage range, the valid samples, the token count and the
per-rollout aggregates are computed here from the step's batch. NeMo-RL divides by GPUs; streamrl
also runs on CPUs, so a ``_per_gpu`` figure is per worker: trainer ranks for training figures,
generators for generation ones, both for end-to-end ones (the table in docs/trainer_records.md).

Called by the control plane once a step's record is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.trainer.batch import Row, StepBatch
from services.trainer.buffer import Group
from shared.protocol import Trajectory
from shared.records import MeanMaxMin, NemoRLMetrics, NemoRLPerformance, NemoRLTiming, NemoRLTrain, StepRecord

NATURAL_END = ("ok", "env_flagged")  # statuses of rollouts the environment itself ended


def mean_max_min(values: Sequence[float]) -> MeanMaxMin:
    """Zeros for no value: a step whose rollouts all failed has no turn to count."""
    if not values:
        return MeanMaxMin(mean=0.0, max=0.0, min=0.0)
    return MeanMaxMin(mean=float(np.mean(values)), max=float(max(values)), min=float(min(values)))


def token_advantages(rows: list[Row]) -> MeanMaxMin:
    """The advantage of every generated token of the batch, as NeMo-RL's ``advantages/*``: over
    the rows' token masks, rows masked out of the loss included; the mean is weighted by tokens."""
    tokens = np.array([r.token_mask.sum() for r in rows], dtype=np.float64)
    advantages = np.array([r.advantage for r in rows], dtype=np.float64)
    generated = tokens > 0
    if not generated.any():
        return MeanMaxMin(mean=0.0, max=0.0, min=0.0)
    return MeanMaxMin(
        mean=float((advantages * tokens).sum() / tokens.sum()),
        max=float(advantages[generated].max()),
        min=float(advantages[generated].min()),
    )


def rollouts(groups: list[Group], rows: list[Row]) -> list[tuple[Trajectory, Row]]:
    """Each of the step's rollouts that is not a placeholder (a failed rollout keeps no turns),
    with its first training row (a rollout split at prefix breaks has more)."""
    first: dict[str, Row] = {}
    for r in rows:
        first.setdefault(r.task_id, r)
    pairs = [(t, first[t.task_id]) for g in groups for t in g.ordered()]
    return [(t, r) for t, r in pairs if not r.placeholder]


def _rate(amount: float, seconds: float, workers: int = 1) -> float:
    """``amount`` per second and worker; 0 for a phase that took no time, as NeMo-RL reports it."""
    return amount / seconds / workers if seconds > 0 else 0.0


def nemo_rl_metrics(record: StepRecord, batch: StepBatch, groups: list[Group], *, trainer_ranks: int) -> NemoRLMetrics:
    """The figures of ``record``'s step under NeMo-RL's names; ``batch`` and ``groups`` are what
    the step trained, ``trainer_ranks`` the trainer's world size."""
    t = record.timing
    policy_training = t.train_s - t.batch_s
    # NeMo-RL's async throughput counts generation as running while the trainer waited and trained.
    generation_time = t.wait_data_s + policy_training
    generators = max(1, len(record.refit.generators))  # those that took the step's weights
    workers = trainer_ranks + generators
    samples = record.batch.num_rows
    tokens = sum(len(r.input_ids) for r in batch.rows if not r.placeholder)
    done = rollouts(groups, batch.rows)
    n = max(1, len(done))
    return NemoRLMetrics(
        timing=NemoRLTiming(
            total_step_time=t.step_s,
            exposed_generation=t.wait_data_s,
            data_processing=t.batch_s,
            policy_training=policy_training,
            weight_sync=record.refit.total_s,
            checkpointing=t.checkpoint_s,
            valid_tokens_per_sec_per_gpu=_rate(record.learner.train_tokens, t.step_s, workers),
        ),
        performance=NemoRLPerformance(
            samples_per_sec=_rate(samples, t.step_s),
            tokens_per_sec=_rate(tokens, t.step_s),
            samples_per_sec_per_gpu=_rate(samples, t.step_s, workers),
            tokens_per_sec_per_gpu=_rate(tokens, t.step_s, workers),
            policy_training_tokens_per_sec_per_gpu=_rate(tokens, policy_training, trainer_ranks),
            training_worker_group_tokens_per_sec=_rate(tokens, policy_training),
            training_worker_group_tokens_per_sec_per_gpu=_rate(tokens, policy_training, trainer_ranks),
            generation_tokens_per_sec=_rate(tokens, generation_time),
            generation_tokens_per_sec_per_gpu=_rate(tokens, generation_time, generators),
        ),
        train=NemoRLTrain(
            reward=record.batch.reward_mean,
            buffer_size=sum(record.buffer.depth.values()),
            avg_trajectory_age=record.staleness.mean,
            num_valid_samples=sum(r.sample_mask > 0 for r in batch.rows),
            total_num_tokens=tokens,
            advantages=token_advantages(batch.rows),
            turns_per_sample=mean_max_min([len(traj.turns) for traj, _ in done]),
            gen_tokens_per_sample=mean_max_min([traj.num_generated_tokens for traj, _ in done]),
            natural_termination_rate=sum(traj.status in NATURAL_END and not r.overlong for traj, r in done) / n,
            truncation_rate=sum(r.overlong for _, r in done) / n,
        ),
    )

"""A training step's record (`shared.records.StepRecord`), built from what the step's parts report.

Called by the control plane once a step is trained, refitted and checkpointed; the record goes to
metrics.jsonl, TensorBoard and the Prometheus metrics (`services.trainer.metrics_log`). Besides the
parts' figures it holds the pipeline's picture: the fraction of the step spent waiting for data, the
learner's model FLOPs utilisation (`services.trainer.flops`), the rollouts' mean duration and the
live workers per kind (`worker_counts`, read from the registry).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.trainer.batch import StepBatch
from services.trainer.buffer import Group, ReplayBuffer, SampleResult, is_placeholder
from services.trainer.flops import MfuMeter
from services.trainer.refit import RefitReport
from services.trainer.scheduler import Scheduler
from shared.keys import RunKeys
from shared.records import (
    BatchStats,
    BufferSummary,
    DynamicSamplingStats,
    LearnerMetrics,
    Staleness,
    StepRecord,
    StepTiming,
)
from shared.registry import live_workers
from shared.run_config import RunConfig

WORKER_KINDS = ("generator", "gym_gateway")  # the kinds a step record counts


@dataclass(frozen=True)
class StepClock:
    """perf_counter readings of a step (start, data ready, batch built, training done) and the
    seconds of its checkpoint phase."""

    start: float
    data_ready: float
    batched: float
    trained: float
    checkpoint_s: float


def staleness_counts(step: int, groups: Iterable[Group]) -> dict[str, int]:
    """{age: trajectories} for a step's groups; age = step - launch version of each trajectory
    (rows that never reached a generator have no version and are left out)."""
    counts: dict[str, int] = {}
    for g in groups:
        for t in g.rows.values():
            if t.launch_version >= 0:
                age = str(step - t.launch_version)
                counts[age] = counts.get(age, 0) + 1
    return counts


def trajectory_spans(groups: Iterable[Group]) -> dict[str, int]:
    """{number of weight versions that generated a trajectory's tokens: trajectories} (rows
    without tokens are left out)."""
    counts: dict[str, int] = {}
    for g in groups:
        for t in g.rows.values():
            versions = {v for turn in t.turns for v in turn.versions()}
            if versions:
                counts[str(len(versions))] = counts.get(str(len(versions)), 0) + 1
    return counts


def staleness(step: int, sample: SampleResult) -> Staleness:
    """Ages by the oldest weight version behind any token of a group (``max``: the worst)."""
    ages = [step - g.gen_version for g in sample.groups]
    offsets: dict[str, int] = {}
    for t in sample.targets:
        offsets[str(t - step)] = offsets.get(str(t - step), 0) + 1
    spans = trajectory_spans(sample.groups)
    spanning = sum(n for k, n in spans.items() if int(k) > 1)
    return Staleness(
        mean=sum(ages) / len(ages),
        max=max(ages),
        counts=staleness_counts(step, sample.groups),
        sampled_target_offsets=offsets,
        trajectory_spans=spans,
        multi_version_fraction=spanning / max(1, sum(spans.values())),
    )


def dynamic_sampling_stats(
    filtered: list[Group], *, num_prompts: int, groups_per_batch: int, filtered_total: int
) -> DynamicSamplingStats:
    """What dynamic sampling did for a step: ``filtered`` groups judged besides the ``num_prompts``
    trained, in generation batches of ``groups_per_batch`` groups."""
    rewards = [t.reward for g in filtered for t in g.rows.values() if not is_placeholder(t)]
    judged = num_prompts + len(filtered)
    return DynamicSamplingStats(
        num_filtered_groups=len(filtered),
        filtered_fraction=len(filtered) / judged,
        num_gen_batches=math.ceil(judged / groups_per_batch),
        filtered_reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
        filtered_total=filtered_total,
    )


async def worker_counts(redis: aioredis.Redis, keys: RunKeys) -> dict[str, int]:
    """Live workers of each of `WORKER_KINDS` in the registry now (0 for a kind with none running)."""
    live = await live_workers(redis, keys)
    return {kind: sum(h.kind == kind for h in live) for kind in WORKER_KINDS}


@dataclass(frozen=True)
class PipelineFigures:
    """A step's figures read outside its parts (`PipelineMeter`)."""

    model_tflops: float | None = None
    mfu: float | None = None
    workers: dict[str, int] | None = None


class PipelineMeter:
    """Measures `PipelineFigures` at a step's end: the learner's MFU over the batch's trainable
    rows (`services.trainer.flops`) and the live workers per kind (the registry)."""

    def __init__(self, cfg: RunConfig, redis: aioredis.Redis, keys: RunKeys, *, devices: int) -> None:
        self.mfu = MfuMeter.from_config(cfg, devices)
        self._redis, self._keys = redis, keys

    async def measure(self, batch: StepBatch, learner: LearnerMetrics) -> PipelineFigures:
        seq_lens = [len(r.input_ids) for r in batch.trainable]
        tflops, mfu = self.mfu.measure(seq_lens, learner.train_time_s)
        return PipelineFigures(model_tflops=tflops, mfu=mfu, workers=await worker_counts(self._redis, self._keys))


def rollout_times(groups: Iterable[Group]) -> tuple[float | None, float | None]:
    """(mean wall seconds from a rollout's start to its publish, mean seconds of its model calls)
    over the groups' rollouts that ran (placeholders and rollouts without times left out)."""
    ran = [t for g in groups for t in g.rows.values() if not is_placeholder(t) and t.finished_at > t.started_at > 0]
    if not ran:
        return None, None
    wall = sum(t.finished_at - t.started_at for t in ran) / len(ran)
    return wall, sum(turn.latency_s for t in ran for turn in t.turns) / len(ran)


def build_step_record(
    step: int,
    sample: SampleResult,
    batch: BatchStats,
    learner: LearnerMetrics,
    refit: RefitReport,
    clock: StepClock,
    *,
    buffer: ReplayBuffer,
    scheduler: Scheduler,
    evicted_ids: list[str],
    group_size: int,
    received_total: int,
    started_at: float,
    dynamic_sampling: DynamicSamplingStats | None = None,
    pipeline: PipelineFigures | None = None,
) -> StepRecord:
    elapsed = time.time() - started_at
    step_s = time.perf_counter() - clock.start
    pipeline = pipeline or PipelineFigures()
    rollout_s, generation_s = rollout_times(sample.groups)
    return StepRecord(
        step=step,
        weight_version=step,
        time=time.time(),
        batch=batch,
        learner=learner,
        staleness=staleness(step, sample),
        buffer=BufferSummary(
            depth={str(k): v for k, v in buffer.depth_by_target().items()},
            in_flight_groups={str(k): v for k, v in scheduler.in_flight_by_target().items()},
            evicted_groups=len(evicted_ids) // group_size,
            evicted_total=buffer.evicted_total,
            duplicates_total=buffer.duplicates_total,
        ),
        timing=StepTiming(
            wait_data_s=clock.data_ready - clock.start,
            train_s=clock.trained - clock.data_ready,
            step_s=step_s,
            batch_s=clock.batched - clock.data_ready,
            checkpoint_s=clock.checkpoint_s,
        ),
        refit=refit.summary(),
        trajectories_received=received_total,
        trajectories_per_s=received_total / max(elapsed, 1e-6),
        dynamic_sampling=dynamic_sampling,
        wait_fraction=(clock.data_ready - clock.start) / step_s if step_s > 0 else None,
        model_tflops=pipeline.model_tflops,
        mfu=pipeline.mfu,
        rollout_s=rollout_s,
        generation_s=generation_s,
        workers=pipeline.workers or {},
        consumed_ids=sorted(t.task_id for g in sample.groups for t in g.rows.values()),
        evicted_ids=sorted(evicted_ids),
        filtered_ids=sorted(t.task_id for g in sample.filtered for t in g.rows.values()),
    )

"""Typed trainer records for tests that need a run's metrics without running one: a step record
as the control plane writes it (refit phases from a real `RefitReport`) and a validation record."""

from __future__ import annotations

from services.trainer.refit import RefitReport
from shared.records import (
    BatchStats,
    BufferSummary,
    LearnerMetrics,
    Staleness,
    StepRecord,
    StepTiming,
    ValidationRecord,
)


def batch_stats(reward_mean: float = 0.5, **fields: object) -> BatchStats:
    values: dict[str, object] = dict(
        reward_mean=reward_mean,
        reward_std=0.2,
        num_rows=16,
        num_placeholders=0,
        num_prefix_breaks=0,
        num_prefix_break_samples=0,
        num_mixed_version_rows=0,
        num_truncated=0,
        num_masked_samples=0,
        num_mask_sample_filtered=0,
        mean_seq_len=40.0,
        gen_tokens=200,
        advantages_abs_mean=0.5,
        zero_advantage_groups=0,
    )
    values.update(fields)
    return BatchStats(**values)  # type: ignore[arg-type]


def learner_metrics(loss: float = 0.1, **fields: object) -> LearnerMetrics:
    values: dict[str, object] = dict(
        loss=loss, grad_norm=0.5, num_updates=1, train_tokens=200, lr=1e-5, train_time_s=2.0
    )
    values.update(fields)
    return LearnerMetrics(**values)  # type: ignore[arg-type]


def step_record(
    step: int,
    *,
    reward_mean: float | None = None,
    staleness_counts: dict[str, int] | None = None,
    refit: RefitReport | None = None,
) -> StepRecord:
    refit = refit or RefitReport(
        version=step + 1,
        save_s=0.2 + 0.01 * step,
        confirm_s=0.5,
        total_s=0.7 + 0.01 * step,
        generators=["generator-0"],
        checksum_s=0.1,
    )
    counts = staleness_counts if staleness_counts is not None else ({"0": 8, "1": 8} if step else {"0": 16})
    return StepRecord(
        step=step,
        weight_version=step,
        time=1000.0 + step,
        batch=batch_stats(0.3 + 0.05 * step if reward_mean is None else reward_mean),
        learner=learner_metrics(0.01 * step),
        staleness=Staleness(mean=0.5, max=max(int(a) for a in counts), counts=counts, sampled_target_offsets={"0": 4}),
        buffer=BufferSummary(
            depth={str(step + 1): 2}, in_flight_groups={}, evicted_groups=0, evicted_total=0, duplicates_total=0
        ),
        timing=StepTiming(wait_data_s=1.0, train_s=2.0, step_s=3.0 + refit.total_s),
        refit=refit.summary(),
        trajectories_received=16 * (step + 1),
        trajectories_per_s=4.0,
        consumed_ids=[f"g{step}/{i}" for i in range(16)],
    )


def validation_record(step: int, accuracy: float, **fields: object) -> ValidationRecord:
    values: dict[str, object] = dict(
        validation_id=f"val-{step}",
        step=step,
        time=2000.0 + step,
        accuracy=accuracy,
        num_samples=16,
        num_failed=0,
        num_missing=0,
        avg_length=12.0,
        duration_s=3.0,
    )
    values.update(fields)
    return ValidationRecord(**values)  # type: ignore[arg-type]

"""The demo section of ``streamrl bench``: one fresh `streamrl demo` run, timed.

Per-step wall time split into waiting for data, training and refit, each as a share of the whole
step; the run's counts; and each figure that has a like baseline in the same run next to it
(reward against the first steps, staleness against its bound, time against time). Run only by
the whole suite (`streamrl.bench.suite`); rendered by ``templates/demo.md.jinja``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec

from streamrl.bench.report import Results, render


class DemoSummary(msgspec.Struct):
    """What the bench reads of the demo's ``summary.json`` (`streamrl.demo.summarize`)."""

    steps: int = 0
    first5_reward: float = 0.0
    last5_reward: float = 0.0
    trajectories_trained: int = 0
    duplicate_ids: int = 0
    validation_accuracy: list[tuple[int, float]] = []  # (step, greedy accuracy)
    total_time_s: float = 0.0


class StepTimes(msgspec.Struct):
    """Seconds per step of the run, by phase."""

    wait_data_s: list[float]
    train_s: list[float]
    refit_s: list[float]
    step_s: list[float]


class Phase(msgspec.Struct):
    """One phase of a step over the run: seconds, and its mean over the whole step's mean."""

    mean_s: float
    p50_s: float
    max_s: float
    share_of_step: float | None


class Timing(msgspec.Struct):
    wait_data: Phase
    train: Phase
    refit: Phase
    step: Phase


class Compared(msgspec.Struct):
    """A figure next to its baseline from the same run; ``ratio`` None when the baseline is 0."""

    value: float
    baseline: float
    ratio: float | None


class DemoResults(Results):
    max_num_steps: int  # grpo.max_num_steps of the demo config
    lag: int  # grpo.async_grpo.max_trajectory_age_steps
    steps: int
    trajectories_per_s: float  # trained, over the whole run's wall clock (the last step's figure)
    timing: Timing | None  # None: no step was trained
    reward: Compared  # mean of the last 5 steps against the first 5
    staleness: Compared  # mean staleness of consumed groups against the lag bound
    duplicates: Compared  # trajectories trained twice against trajectories trained
    accuracy: Compared | None  # greedy validation at the end against the start; None: none ran
    total_time: Compared  # seconds of the whole demo against its training loop's (sum of steps)


def ratio(value: float, base: float) -> float | None:
    return value / base if base else None


def compared(value: float, base: float) -> Compared:
    return Compared(value, base, ratio(value, base))


def _phase(values: list[float], step_mean: float) -> Phase:
    mean = statistics.mean(values)
    return Phase(mean, statistics.median(values), max(values), ratio(mean, step_mean))


def summarize(
    times: StepTimes,
    summary: DemoSummary,
    *,
    trajectories_per_s: float,
    staleness_mean: float,
    max_num_steps: int,
    lag: int,
) -> DemoResults:
    """The section's figures from the run's per-step times and its summary."""
    timing = None
    if times.step_s:
        step = statistics.mean(times.step_s)
        timing = Timing(*(_phase(v, step) for v in (times.wait_data_s, times.train_s, times.refit_s, times.step_s)))
    acc = [a for _, a in summary.validation_accuracy]
    return DemoResults(
        max_num_steps=max_num_steps,
        lag=lag,
        steps=summary.steps,
        trajectories_per_s=trajectories_per_s,
        timing=timing,
        reward=compared(summary.last5_reward, summary.first5_reward),
        staleness=compared(staleness_mean, lag),
        duplicates=compared(summary.duplicate_ids, summary.trajectories_trained),
        accuracy=compared(acc[-1], acc[0]) if acc else None,
        total_time=compared(summary.total_time_s, sum(times.step_s)),
    )


def demo_benchmark(out_dir: Path) -> tuple[int, DemoResults]:
    """A fresh demo run in ``out_dir`` (its warm start timed too); its exit code and figures."""
    import shutil

    from shared.config import load
    from shared.records import read_records, step_records
    from shared.run_config import RunConfig
    from streamrl.demo import CONFIG, run_demo
    from streamrl.demo import summarize as demo_summary

    shutil.rmtree(out_dir, ignore_errors=True)  # time the warm start too
    code = run_demo(out_dir, progress=False)
    steps = step_records(read_records(out_dir / "metrics.jsonl"))
    cfg = load(RunConfig, CONFIG, env={})
    times = StepTimes(
        wait_data_s=[r.timing.wait_data_s for r in steps],
        train_s=[r.timing.train_s for r in steps],
        refit_s=[r.refit.total_s for r in steps],
        step_s=[r.timing.step_s for r in steps],
    )
    path = out_dir / "summary.json"
    summary = (
        msgspec.json.decode(path.read_bytes(), type=DemoSummary)
        if path.is_file()
        else msgspec.convert(demo_summary(out_dir), DemoSummary)
    )
    results = summarize(
        times,
        summary,
        trajectories_per_s=steps[-1].trajectories_per_s if steps else 0.0,
        staleness_mean=statistics.mean(r.staleness.mean for r in steps) if steps else 0.0,
        max_num_steps=cfg.grpo.max_num_steps,
        lag=cfg.grpo.async_grpo.max_trajectory_age_steps,
    )
    return code, results


def render_section(r: DemoResults) -> str:
    return render("demo", r=r)

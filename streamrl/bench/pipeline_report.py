"""The pipeline-efficiency section's results and targets (`streamrl.bench.pipeline` measures, this
module holds what it found): `PipelineResults`, the targets checked against them, rendered by
``templates/pipeline.md.jinja``."""

from __future__ import annotations

import msgspec

from streamrl.bench.packing import PackingResults
from streamrl.bench.report import Results, render
from streamrl.bench.schedule import LONG_RUN_SEEDS, LONG_RUN_STEPS, IdealRun

EFFICIENCY_TARGET = 0.95  # real steps/hour over the ideal schedule's
PACKING_TARGET = 0.95
REAL_RUN_ATTEMPTS = 2
CONTENDED_OVERSHOOT_S = 0.05  # a train_step sleep this much late: the host's CPU was taken
CONTENDED_OTHER_CPU = 0.5  # cores used by other processes of the host during a run


class Latencies(msgspec.Struct):
    """Per rollout issued after start-up, where its time goes outside its simulated duration."""

    pickup_mean_s: float  # task published -> the gateway starts the rollout
    pickup_max_s: float
    open_mean_s: float  # -> the environment starts
    open_max_s: float
    delivery_mean_s: float  # rollout done -> the trainer reads the trajectory
    delivery_max_s: float
    last_start_mean_s: float  # per issue: until the last of its rollouts starts


class RealRun(msgspec.Struct, kw_only=True):
    """One run of the real trainer loop: its measured window, where its time went, and the host."""

    steps_per_hour: float
    busy_fraction: float
    issued_groups: int
    evicted_groups: int
    peak_rollouts: int  # running at once in the gateways
    mean_gap_s: float  # between the end of one training and the start of the next
    mean_refit_s: float
    max_refit_s: float
    mean_wait_data_s: float
    other_gap_s: float  # the gap less refit and waiting for data: issue, ack, metrics, batch build
    latencies: Latencies
    # the host during the run
    attempts: int = 1
    max_train_overshoot_s: float
    other_cpu_cores: float  # CPU other processes of the host used meanwhile
    run_wall_s: float

    @property
    def contended(self) -> bool:
        """Disturbed by other processes: it measures the host as much as the pipeline."""
        return self.max_train_overshoot_s > CONTENDED_OVERSHOOT_S or self.other_cpu_cores > CONTENDED_OTHER_CPU


class LagRun(msgspec.Struct):
    """A scenario at one lag, real and ideal, and each against lag 0 (synchronous)."""

    lag: int
    real: RealRun
    ideal: IdealRun
    efficiency: float  # real steps/hour over ideal
    speedup_real: float  # steps/hour over lag 0's
    speedup_ideal: float
    speedup_long_run: float  # the ideal schedule over LONG_RUN_STEPS, mean of LONG_RUN_SEEDS seeds


class ScenarioFacts(msgspec.Struct, kw_only=True):
    """A scenario as it was run (`streamrl.bench.schedule.Scenario`), with its rollout times."""

    name: str
    description: str
    rollout_median_s: float
    sigma: float
    p99_over_p50: float
    sampled_p99_over_p50: float
    makespan_over_train: float
    train_s: float
    steps: int
    num_prompts: int
    group_size: int
    target_lag: int
    target_speedup: float


class ScenarioResults(msgspec.Struct):
    facts: ScenarioFacts
    runs: list[LagRun]

    def run(self, lag: int) -> LagRun:
        return next(r for r in self.runs if r.lag == lag)


class PipelineResults(Results):
    date: str
    machine: str
    measure_from_step: int
    gateway_workers: int
    gateway_slots_per_worker: int
    scenarios: list[ScenarioResults]
    packing: PackingResults


def lag_run(lag: int, real: RealRun, ideal: IdealRun, sync: tuple[RealRun, IdealRun], long_run: float) -> LagRun:
    """``lag``'s run against the ideal schedule, and each against its lag-0 run ``sync``."""
    return LagRun(
        lag=lag,
        real=real,
        ideal=ideal,
        efficiency=real.steps_per_hour / ideal.steps_per_hour,
        speedup_real=real.steps_per_hour / sync[0].steps_per_hour,
        speedup_ideal=ideal.steps_per_hour / sync[1].steps_per_hour,
        speedup_long_run=long_run,
    )


def targets(results: PipelineResults) -> list[tuple[str, str, bool]]:
    """(target, measured figure, met) for every target of the section."""
    rows: list[tuple[str, str, bool]] = []
    for sc in results.scenarios:
        f = sc.facts
        for r in sc.runs:
            target = f"{f.name}, lag {r.lag}: real >= {EFFICIENCY_TARGET:.0%} of the ideal schedule's steps/hour"
            rows.append((target, f"{r.efficiency:.1%}", r.efficiency >= EFFICIENCY_TARGET))
        t = sc.run(f.target_lag)
        rows.append(
            (
                f"{f.name}: lag {f.target_lag} >= {f.target_speedup}x synchronous",
                f"real {t.speedup_real:.2f}x (ideal {t.speedup_ideal:.2f}x)",
                t.speedup_real >= f.target_speedup,
            )
        )
    p = results.packing
    measured = f"{p.packing_mean:.1%} (min {p.packing_min:.1%})"
    rows.append((f"packing efficiency >= {PACKING_TARGET:.0%}", measured, p.packing_min >= PACKING_TARGET))
    return rows


def render_pipeline(results: PipelineResults) -> str:
    """The markdown section for the results of `run_pipeline_benchmark`."""
    return render(
        "pipeline",
        r=results,
        first=results.scenarios[0].facts,
        targets=targets(results),
        long_run_steps=LONG_RUN_STEPS,
        long_run_seeds=LONG_RUN_SEEDS,
        attempts=REAL_RUN_ATTEMPTS,
        contended_cpu=CONTENDED_OTHER_CPU,
        contended_ms=CONTENDED_OVERSHOOT_S * 1000,
    )

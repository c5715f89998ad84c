"""The pipeline benchmark's pure parts: the ideal-schedule simulator, the figures taken from a
schedule, the scenarios' rollout times, the sleep environment's order, packing and the section."""

from __future__ import annotations

import statistics

import pytest

from services.gym_gateway.envs import UnknownEnvironment, get_env
from streamrl.bench.packing import PackingCase, packing_benchmark
from streamrl.bench.pipeline import run_config, scenario_facts
from streamrl.bench.pipeline_report import (
    Latencies,
    PipelineResults,
    RealRun,
    ScenarioResults,
    lag_run,
    render_pipeline,
    targets,
)
from streamrl.bench.schedule import SCENARIOS, Scenario, ideal_run, pipeline_figures, simulate_schedule
from streamrl.bench.sleep_env import ENV_NAME, SleepEnv, registered_env

pytestmark = pytest.mark.unit


def _const(seconds: float):
    return lambda prompt, attempt: seconds


def _periods(ends: list[float]) -> list[float]:
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def _schedule(makespan, *, lag: int, steps: int = 12, n: int = 2, train_s: float = 1.0):
    return simulate_schedule(makespan, num_prompts=n, lag=lag, train_s=train_s, steps=steps, dataset_size=1000)


def test_synchronous_steps_take_generation_plus_training():
    s = _schedule(_const(2.0), lag=0, steps=5)
    assert s.train_start == pytest.approx([2, 5, 8, 11, 14])
    assert s.train_end == pytest.approx([3, 6, 9, 12, 15])
    assert (s.issued_groups, s.evicted_groups) == (10, 0)
    f = pipeline_figures(s.train_start, s.train_end, from_step=1)
    assert f.steps_per_hour == pytest.approx(1200)
    assert f.busy_fraction == pytest.approx(1 / 3)
    assert f.measured_steps == 3


def test_the_ceilings_with_fixed_rollout_times():
    # Generation as long as training: one step of overlap halves the step (2x), a second adds nothing.
    for lag, period in ((0, 2.0), (1, 1.0), (2, 1.0)):
        assert _periods(_schedule(_const(1.0), lag=lag).train_end)[-5:] == pytest.approx([period] * 5)
    # Generation twice as long as training: lag 1 overlaps half of it, lag 2 keeps the trainer busy (3x).
    for lag, period in ((0, 3.0), (1, 1.5), (2, 1.0)):
        periods = _periods(_schedule(_const(2.0), lag=lag, steps=20).train_end)
        assert statistics.mean(periods[-8:]) == pytest.approx(period)


def test_lookahead_barrier_waits_for_the_first_two_targets():
    slow_second_target = lambda prompt, attempt: 5.0 if prompt in (2, 3) else 1.0  # noqa: E731
    assert _schedule(slow_second_target, lag=1).train_start[0] == pytest.approx(5.0)
    assert _schedule(slow_second_target, lag=0).train_start[0] == pytest.approx(1.0)


def test_a_straggler_is_bypassed_then_evicted_and_its_prompt_reused():
    attempts: list[tuple[int, int]] = []

    def makespan(prompt: int, attempt: int) -> float:
        attempts.append((prompt, attempt))
        return 30.0 if (prompt, attempt) == (6, 0) else 1.0

    s = _schedule(makespan, lag=1, steps=40)
    # A slow group of target 3 is replaced by one issued for target 4: no step waits for it.
    assert max(b - a for a, b in zip(s.train_end, s.train_start[1:], strict=False)) <= 1.0 + 1e-9
    assert s.evicted_groups == 1  # it came back too stale to train on
    assert (6, 1) in attempts  # and its prompt was issued again
    synchronous = _schedule(makespan, lag=0, steps=40)
    assert synchronous.train_start[3] == pytest.approx(6.0 + 30.0)  # lag 0 can only wait
    assert synchronous.evicted_groups == 0 and synchronous.issued_groups == 80


def test_every_step_trains_and_no_group_is_counted_twice():
    scenario = SCENARIOS[1]
    for lag in (0, 1, 2):
        s = _schedule(
            scenario.group_makespan, lag=lag, steps=scenario.steps, n=scenario.num_prompts, train_s=scenario.train_s
        )
        trained = scenario.steps * scenario.num_prompts
        assert s.issued_groups >= trained + s.evicted_groups
        assert s.train_start == sorted(s.train_start)
        assert all(e - b == pytest.approx(scenario.train_s) for b, e in zip(s.train_start, s.train_end, strict=True))


def test_ideal_run_reports_figures_of_the_measured_window():
    r = ideal_run(SCENARIOS[0], 1)
    assert r.measured_steps == SCENARIOS[0].steps - 2
    assert 0 < r.busy_fraction <= 1
    assert r.steps_per_hour <= 3600 / SCENARIOS[0].train_s + 1e-6


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenarios_are_heavy_tailed_and_calibrated(scenario: Scenario):
    assert scenario.p99_over_p50 >= 10
    draws = [d for p in range(500) for d in scenario.durations(p, 0)]
    assert statistics.median(draws) == pytest.approx(scenario.rollout_median_s, rel=0.1)
    per_step = scenario.num_prompts
    makespans = [max(scenario.group_makespan(p, 0) for p in range(i, i + per_step)) for i in range(0, 4000, per_step)]
    assert statistics.median(makespans) == pytest.approx(scenario.makespan_over_train * scenario.train_s, rel=0.08)


def test_durations_are_fixed_per_prompt_attempt():
    s = SCENARIOS[0]
    assert s.durations(3, 0) == s.durations(3, 0)
    assert s.durations(3, 0) != s.durations(3, 1)
    assert len(s.durations(3, 0)) == s.group_size
    assert s.group_makespan(3, 1) == max(s.durations(3, 1))


def test_sleep_env_hands_out_a_prompts_durations_in_order():
    s = SCENARIOS[0]
    env = SleepEnv(s)
    got = [env.next_duration(7) for _ in range(2 * s.group_size)]
    assert got == s.durations(7, 0) + s.durations(7, 1)
    assert env.next_duration(8) == s.durations(8, 0)[0]


def test_the_sleep_env_is_registered_only_inside_the_context():
    env = SleepEnv(SCENARIOS[0])
    with registered_env(env):
        assert get_env(ENV_NAME) is env
        with pytest.raises(RuntimeError, match="already registered"), registered_env(env):
            pass
    with pytest.raises(UnknownEnvironment):
        get_env(ENV_NAME)


def test_run_config_is_a_valid_run_at_the_scenarios_lag(tmp_path):
    s = SCENARIOS[0]
    cfg = run_config(s, 2, redis_url="redis://127.0.0.1:1/0", run_id="r", work=tmp_path)
    assert cfg.grpo.async_grpo.max_trajectory_age_steps == 2
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (s.num_prompts, s.group_size)
    assert cfg.env.name == ENV_NAME and not cfg.checkpointing.enabled
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) == s.dataset_size


def test_packing_beats_padding_on_heavy_tailed_lengths():
    p = packing_benchmark(PackingCase(rows=128, batches=3))
    assert p.packing_min >= 0.95
    assert p.padding_mean < p.packing_mean
    assert p.packs_mean >= p.packs_lower_bound_mean


def _real(steps_per_hour: float, ideal) -> RealRun:
    return RealRun(
        steps_per_hour=steps_per_hour,
        busy_fraction=ideal.busy_fraction,
        issued_groups=ideal.issued_groups,
        evicted_groups=ideal.evicted_groups,
        peak_rollouts=64,
        mean_gap_s=ideal.mean_gap_s,
        mean_refit_s=0.01,
        max_refit_s=0.02,
        mean_wait_data_s=0.1,
        other_gap_s=ideal.mean_gap_s - 0.11,
        latencies=Latencies(*[0.01] * 6, last_start_mean_s=0.05),
        attempts=1,
        max_train_overshoot_s=0.001,
        other_cpu_cores=0.1,
        run_wall_s=30.0,
    )


def _results(real_factor: float) -> PipelineResults:
    """Results whose real runs reach ``real_factor`` of the ideal steps/hour."""
    scenarios = []
    long_run = {0: 1.0, 1: 1.9, 2: 2.9}
    for s in SCENARIOS:
        measured = {}
        for lag in (0, 1, 2):
            ideal = ideal_run(s, lag)
            measured[lag] = (_real(ideal.steps_per_hour * real_factor, ideal), ideal)
        runs = [lag_run(lag, real, ideal, measured[0], long_run[lag]) for lag, (real, ideal) in measured.items()]
        scenarios.append(ScenarioResults(scenario_facts(s), runs))
    return PipelineResults(
        date="today",
        machine="m",
        measure_from_step=1,
        gateway_workers=8,
        gateway_slots_per_worker=64,
        scenarios=scenarios,
        packing=packing_benchmark(PackingCase(rows=64, batches=2)),
    )


def test_targets_compare_real_runs_with_the_ideal_schedule():
    met = {t: ok for t, _, ok in targets(_results(0.97))}
    assert all(ok for t, ok in met.items() if "of the ideal schedule" in t)
    missed = {t: ok for t, _, ok in targets(_results(0.9))}
    assert not any(ok for t, ok in missed.items() if "of the ideal schedule" in t)
    assert len(met) == 2 * 3 + 2 + 1


def test_render_pipeline_is_one_markdown_section():
    text = render_pipeline(_results(0.97))
    assert text.startswith("## Pipeline efficiency\n")
    assert sum(line.startswith("## ") for line in text.splitlines()) == 1
    assert "| balanced | 1 |" in text and "| heavy-tailed | 2 |" in text
    assert "| packed (first-fit decreasing) |" in text

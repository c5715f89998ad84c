"""Scenarios and the ideal schedule of the pipeline-efficiency benchmark (`streamrl.bench.pipeline`).

A scenario fixes seeded log-normal rollout times (every prompt attempt has the same durations in
every run) and the training time. The ideal schedule is an event simulation of the trainer's own
scheduling policy (lag window, current/late/future groups, evictions, prompt reuse, lookahead
barrier) with zero-time refit, issue and delivery: what the real loop is measured against. Pure
Python and numpy; no services.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

LAGS = (0, 1, 2)
MEASURE_FROM_STEP = 1  # the window starts when training of this step (0-based) ends
LONG_RUN_STEPS = 2000  # the ideal schedule over a long run: the structural ratio, free of sample noise
LONG_RUN_SEEDS = 5


# -- scenarios -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Log-normal rollout times (log-sd ``sigma``), scaled so the median makespan of one step's
    N x G rollouts (its slowest rollout) is ``makespan_over_train`` x the training time."""

    name: str
    description: str
    sigma: float
    makespan_over_train: float
    train_s: float
    num_prompts: int  # N groups per step
    group_size: int  # G rollouts per group
    steps: int
    seed: int
    target_lag: int  # the lag whose speed-up over synchronous has a target here
    target_speedup: float

    @property
    def rollout_median_s(self) -> float:
        """Median of one rollout: the median of the max of m draws sits at quantile 0.5 ** (1 / m)."""
        m = self.num_prompts * self.group_size
        z = statistics.NormalDist().inv_cdf(0.5 ** (1 / m))
        return self.makespan_over_train * self.train_s / math.exp(self.sigma * z)

    @property
    def p99_over_p50(self) -> float:
        return math.exp(self.sigma * statistics.NormalDist().inv_cdf(0.99))

    def durations(self, prompt: int, attempt: int) -> list[float]:
        """The G rollout times of a prompt's ``attempt``-th group (seeded, the same every run)."""
        z = np.random.default_rng([self.seed, prompt, attempt]).standard_normal(self.group_size)
        times: list[float] = (self.rollout_median_s * np.exp(self.sigma * z)).tolist()
        return times

    def group_makespan(self, prompt: int, attempt: int) -> float:
        return max(self.durations(prompt, attempt))

    @property
    def dataset_size(self) -> int:
        """Prompts in the benchmark's dataset: more than a run takes, so no epoch wraps."""
        return 20 * self.steps * self.num_prompts


SCENARIOS = (
    Scenario(
        name="balanced",
        description="median step makespan = training time",
        sigma=1.0,
        makespan_over_train=1.0,
        train_s=1.0,
        num_prompts=8,
        group_size=8,
        steps=24,
        seed=1,
        target_lag=1,
        target_speedup=1.9,
    ),
    Scenario(
        name="heavy-tailed",
        description="training short against the generation tail: median step makespan = 2.5 x training time",
        sigma=1.0,
        makespan_over_train=2.5,
        train_s=1.0,
        num_prompts=8,
        group_size=8,
        steps=24,
        seed=2,
        target_lag=2,
        target_speedup=2.8,
    ),
)


# -- the ideal schedule ----------------------------------------------------------------------------


@dataclass
class Schedule:
    train_start: list[float]
    train_end: list[float]
    issued_groups: int
    evicted_groups: int


@dataclass
class _SimGroup:
    prompt: int
    target: int
    version: int  # weights that generated it


class _IdealPipeline:
    """Zero-overhead replay of the trainer's scheduling policy; see the module docstring."""

    def __init__(
        self,
        makespan: Callable[[int, int], float],
        *,
        num_prompts: int,
        lag: int,
        train_s: float,
        steps: int,
        dataset_size: int,
    ) -> None:
        self.makespan = makespan
        self.n, self.lag, self.train_s, self.steps = num_prompts, lag, train_s, steps
        self.dataset_size = dataset_size
        self.now = 0.0
        self.pos = 0
        self.returned: deque[int] = deque()
        self.attempts: dict[int, int] = defaultdict(int)
        self.in_flight: list[tuple[float, int, _SimGroup]] = []  # heap by completion time
        self.in_flight_by_target: dict[int, int] = defaultdict(int)
        self.staged: dict[int, list[_SimGroup]] = defaultdict(list)  # targets with staged groups only
        self.issued = 0
        self.evicted = 0

    def _take_prompt(self) -> int:
        if self.returned:
            return self.returned.popleft()
        p = self.pos % self.dataset_size
        self.pos += 1
        return p

    def _usable(self, g: _SimGroup, step: int) -> bool:
        return step - self.lag <= g.version <= step

    def _count_usable(self, target: int) -> int:
        return sum(self._usable(g, target) for g in self.staged.get(target, ()))

    def issue(self, step: int) -> None:
        for target in range(step, min(step + self.lag, self.steps - 1) + 1):
            missing = self.n - self.in_flight_by_target[target] - self._count_usable(target)
            for _ in range(max(0, missing)):
                prompt = self._take_prompt()
                attempt = self.attempts[prompt]
                self.attempts[prompt] += 1
                done = self.now + self.makespan(prompt, attempt)
                heapq.heappush(self.in_flight, (done, self.issued, _SimGroup(prompt, target, step)))
                self.in_flight_by_target[target] += 1
                self.issued += 1

    def advance_to(self, t: float) -> None:
        self.now = t
        while self.in_flight and self.in_flight[0][0] <= t:
            _, _, g = heapq.heappop(self.in_flight)
            self.in_flight_by_target[g.target] -= 1
            self.staged[g.target].append(g)

    def next_arrival(self) -> None:
        if not self.in_flight:
            raise RuntimeError("ideal schedule stalled: nothing in flight and no batch staged")
        self.advance_to(self.in_flight[0][0])

    def sample(self, step: int) -> tuple[list[_SimGroup], list[_SimGroup]]:
        """(taken, evicted), as `ReplayBuffer.sample`: nothing is taken unless N usable groups exist."""
        evicted: list[_SimGroup] = []
        for target in list(self.staged):
            evicted += [g for g in self.staged[target] if not self._usable(g, step)]
            self.staged[target] = [g for g in self.staged[target] if self._usable(g, step)]
            if not self.staged[target]:
                del self.staged[target]
        self.evicted += len(evicted)
        order = sorted(self.staged, key=lambda t: (t != step, t > step, t))  # current, late, future
        candidates = [g for t in order for g in self.staged[t]][: self.n]
        if len(candidates) < self.n:
            return [], evicted
        for g in candidates:
            self.staged[g.target].remove(g)
            if not self.staged[g.target]:
                del self.staged[g.target]
        return candidates, evicted

    def run(self) -> Schedule:
        self.issue(0)
        first = [0] + ([1] if self.lag > 0 and self.steps > 1 else [])
        while not all(self._count_usable(t) >= self.n for t in first):
            self.next_arrival()
        starts: list[float] = []
        ends: list[float] = []
        for step in range(self.steps):
            while True:
                taken, evicted = self.sample(step)
                for g in evicted:
                    self.returned.appendleft(g.prompt)
                if taken:
                    break
                if evicted:
                    self.issue(step)
                self.next_arrival()
            starts.append(self.now)
            self.advance_to(self.now + self.train_s)
            ends.append(self.now)
            self.issue(step + 1)
        return Schedule(starts, ends, self.issued, self.evicted)


def simulate_schedule(
    makespan: Callable[[int, int], float], *, num_prompts: int, lag: int, train_s: float, steps: int, dataset_size: int
) -> Schedule:
    """The trainer's scheduling policy replayed at zero overhead for these group makespans (prompt,
    attempt -> seconds from issue until the group's last rollout ends)."""
    return _IdealPipeline(
        makespan, num_prompts=num_prompts, lag=lag, train_s=train_s, steps=steps, dataset_size=dataset_size
    ).run()


class Window(msgspec.Struct):
    """A run's measured window: from the end of training of MEASURE_FROM_STEP to the end of the last step."""

    steps_per_hour: float
    busy_fraction: float  # time in train_step over the window
    window_s: float
    measured_steps: int


class IdealRun(msgspec.Struct):
    """The ideal schedule's figures for a scenario at one lag."""

    steps_per_hour: float
    busy_fraction: float
    measured_steps: int
    issued_groups: int
    evicted_groups: int
    mean_gap_s: float  # between the end of one training and the start of the next, measured steps


def pipeline_figures(train_start: list[float], train_end: list[float], *, from_step: int = MEASURE_FROM_STEP) -> Window:
    """Steps per hour and busy fraction from the end of training of ``from_step`` to the end of the last step."""
    window = train_end[-1] - train_end[from_step]
    busy = sum(e - s for s, e in zip(train_start[from_step + 1 :], train_end[from_step + 1 :], strict=True))
    steps = len(train_end) - 1 - from_step
    return Window(steps / window * 3600.0, busy / window, window, steps)


def ideal_run(scenario: Scenario, lag: int, *, steps: int | None = None, seed: int | None = None) -> IdealRun:
    """The figures of the ideal schedule for a scenario (optionally over other steps or another seed)."""
    s = scenario if seed is None else dataclasses.replace(scenario, seed=seed)
    sched = simulate_schedule(
        s.group_makespan,
        num_prompts=s.num_prompts,
        lag=lag,
        train_s=s.train_s,
        steps=steps or s.steps,
        dataset_size=s.dataset_size,
    )
    gaps = [
        b - a
        for a, b in zip(sched.train_end[MEASURE_FROM_STEP:-1], sched.train_start[MEASURE_FROM_STEP + 1 :], strict=True)
    ]
    w = pipeline_figures(sched.train_start, sched.train_end)
    return IdealRun(
        steps_per_hour=w.steps_per_hour,
        busy_fraction=w.busy_fraction,
        measured_steps=w.measured_steps,
        issued_groups=sched.issued_groups,
        evicted_groups=sched.evicted_groups,
        mean_gap_s=statistics.mean(gaps),
    )


def long_run_speedups(scenario: Scenario) -> dict[int, float]:
    """Ideal steps/hour over synchronous for each lag over LONG_RUN_STEPS steps, averaged over seeds."""
    out: dict[int, list[float]] = defaultdict(list)
    for seed in range(LONG_RUN_SEEDS):
        rates = {lag: ideal_run(scenario, lag, steps=LONG_RUN_STEPS, seed=1000 + seed).steps_per_hour for lag in LAGS}
        for lag in LAGS:
            out[lag].append(rates[lag] / rates[0])
    return {lag: statistics.mean(v) for lag, v in out.items()}

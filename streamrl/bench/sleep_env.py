"""The benchmarks' rollout stand-in (`streamrl.bench.pipeline`, `streamrl.bench.autoscale`): an
environment that sleeps a seeded log-normal duration per rollout and calls no model, registered for
a run only. Light on purpose (no torch): a gateway process that runs it starts in about a second.

Each prompt's k-th attempt has a fixed set of G durations (`Scenario.durations`), so every run of
a benchmark sees the same rollout times. ``slowdown`` multiplies the durations of prompts from
``slowdown_from_prompt`` on (rows are issued in order, so this is "from about that step on").
A rollout with no model call has no turns: the trainer treats its rows as placeholders, which costs
nothing here.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from contextlib import AbstractContextManager
from typing import Any

from services.gym_gateway import envs
from services.gym_gateway.envs.base import Environment, ModelClient, Outcome
from shared.sections.gateway import EnvSection
from streamrl.bench.schedule import Scenario

ENV_NAME = "bench_sleep"


class SleepEnv:
    """A prompt's rollouts sleep the scenario's durations, in order (its k-th rollout is row k % G
    of attempt k // G), and call no model."""

    name = ENV_NAME

    def __init__(self, scenario: Scenario, *, slowdown: float = 1.0, slowdown_from_prompt: int | None = None) -> None:
        self.scenario = scenario
        self.slowdown = slowdown
        self.slowdown_from_prompt = slowdown_from_prompt
        self.started: dict[int, int] = defaultdict(int)
        self.running = 0
        self.peak = 0

    def next_duration(self, prompt: int) -> float:
        k = self.started[prompt]
        self.started[prompt] += 1
        g = self.scenario.group_size
        seconds = self.scenario.durations(prompt, k // g)[k % g]
        if self.slowdown_from_prompt is not None and prompt >= self.slowdown_from_prompt:
            seconds *= self.slowdown
        return seconds

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> SleepEnv:
        raise NotImplementedError("built by the benchmark with its scenario (plugged in by `registered_env`)")

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        raise ValueError(f"{ENV_NAME} rows are written by the benchmark ({{'prompt': i}}), not generated")

    async def aclose(self) -> None:
        """Nothing is kept between rollouts."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        seconds = self.next_duration(int(instance["prompt"]))
        sleep_from = time.time()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
        return Outcome(reward=0.0, metrics={"sim_rollout_s": seconds, "sim_sleep_from": sleep_from})


def registered_env(env: SleepEnv) -> AbstractContextManager[Environment]:
    """Make ``env`` resolvable by name for the duration of a run."""
    return envs.registered(env)

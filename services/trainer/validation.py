"""Validation runs: issue k tasks per validation prompt (``grpo.val_num_generations_per_prompt``)
with the validation sampling profile, collect the scored trajectories, and report a
`shared.records.ValidationRecord`:

* ``accuracy``: the mean reward over all rollouts (pass@1 averaged over the k samples),
* with k > 1: ``pass_k`` (share of prompts where any of the k rollouts has reward > 0) and
  ``pass_all_k`` (share of prompts where all k do),
* ``avg_length`` (generated tokens per rollout), counts of missing and failed rollouts, and the
  mean of each environment metric (``env``).

    run: publish the tasks -> wait until every rollout arrived or the deadline -> summarize

The validation controller (`services.trainer.validation_control`) decides when a validation runs
and pauses training-task issue around it. Validation trajectories arrive on the same stream as
training ones (``kind == "validation"``); the trainer's intake hands them to `deliver`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from services.trainer import tracing_spans
from services.trainer.scheduler import group_tasks
from shared.jsonl import read_jsonl
from shared.protocol import SamplingParams, Trajectory
from shared.records import ValidationRecord
from shared.run_config import RunConfig
from shared.streams import StreamClient
from shared.wakeup import Wakeup

log = logging.getLogger(__name__)


class ValidationRunner:
    def __init__(
        self,
        streams: StreamClient,
        rows: list[dict[str, Any]],
        *,
        sampling: SamplingParams,
        default_env: str,
        max_samples: int | None,
        rollout_timeout_s: float,
        generations_per_prompt: int = 1,
    ) -> None:
        self.streams = streams
        self.rows = rows[: max_samples or len(rows)]
        self.sampling = sampling
        self.default_env = default_env
        self.rollout_timeout_s = rollout_timeout_s
        self.k = generations_per_prompt
        self.id_prefix = ""  # "r<incarnation>-" once `set_incarnation` was told the trainer's start
        self._results: dict[str, Trajectory] = {}
        self._expected: set[str] = set()
        self._arrived = Wakeup()

    @classmethod
    def from_config(cls, cfg: RunConfig, streams: StreamClient) -> ValidationRunner | None:
        """The run's validation runner, or None without ``data.val_path``."""
        if not cfg.data.val_path:
            return None
        return cls(
            streams,
            read_jsonl(cfg.data.val_path),
            sampling=cfg.policy.generation.sampling("validation"),
            default_env=cfg.env.name,
            max_samples=cfg.grpo.max_val_samples,
            rollout_timeout_s=cfg.gym_gateway.rollout_timeout_s,
            generations_per_prompt=cfg.grpo.val_num_generations_per_prompt,
        )

    def set_incarnation(self, incarnation: int) -> None:
        """Prefix the group ids of validations run from now on with this trainer start's
        incarnation, so they stay unique across trainer restarts."""
        self.id_prefix = f"r{incarnation}-"

    def deliver(self, traj: Trajectory) -> None:
        if traj.group_id in self._expected:
            self._results[traj.task_id] = traj
            self._arrived.set()
        else:
            log.warning("validation trajectory %s belongs to no running validation; dropped", traj.task_id)

    async def run(self, step: int, validation_id: str) -> ValidationRecord:
        t0 = time.perf_counter()
        tasks = [
            task
            for i, row in enumerate(self.rows)
            for task in group_tasks(
                f"{self.id_prefix}{validation_id}-{i:05d}",
                i,
                row,
                size=self.k,
                kind="validation",
                target_step=step,
                sampling=self.sampling,
                deadline_s=self.rollout_timeout_s,
                default_env=self.default_env,
            )
        ]
        self._expected = {t.group_id for t in tasks}
        self._results = {}
        with tracing_spans.issued(tasks):
            await self.streams.publish_many(self.streams.keys.tasks, tasks)
        deadline = time.monotonic() + self.rollout_timeout_s
        while len(self._results) < len(tasks) and time.monotonic() < deadline:
            await self._arrived.wait(1.0)
        missing = len(tasks) - len(self._results)
        if missing:
            log.error("validation %s: %d of %d rollouts missing at the deadline", validation_id, missing, len(tasks))
        results = list(self._results.values())
        self._expected = set()
        return summarize(
            results,
            self.k,
            validation_id=validation_id,
            step=step,
            num_missing=missing,
            duration_s=time.perf_counter() - t0,
        )


def periodic_due(steps_done: int, val_period: int, val_start_at: int) -> bool:
    """Periodic validation at the boundary after ``steps_done`` steps: every ``val_period`` steps,
    once ``val_start_at`` steps are done; the cadence stays on multiples of the period."""
    return val_period > 0 and steps_done > 0 and steps_done % val_period == 0 and steps_done >= val_start_at


def summarize(
    results: list[Trajectory],
    k: int,
    *,
    validation_id: str = "",
    step: int = 0,
    num_missing: int = 0,
    duration_s: float = 0.0,
) -> ValidationRecord:
    """Accuracy, pass@k, lengths and env metrics of one validation's rollouts."""
    rewards = [t.reward for t in results]
    pass_k = pass_all_k = None
    if k > 1:
        by_prompt: dict[str, list[float]] = {}
        for t in results:
            by_prompt.setdefault(t.group_id, []).append(t.reward)
        n = len(by_prompt) or 1
        pass_k = sum(any(r > 0 for r in rs) for rs in by_prompt.values()) / n
        pass_all_k = sum(len(rs) == k and all(r > 0 for r in rs) for rs in by_prompt.values()) / n
    sums: dict[str, float] = {}
    for t in results:
        for name, v in t.metrics.items():
            sums[name] = sums.get(name, 0.0) + float(v)
    return ValidationRecord(
        validation_id=validation_id,
        step=step,
        time=time.time(),
        accuracy=sum(rewards) / len(rewards) if rewards else 0.0,
        num_samples=len(rewards),
        num_failed=sum(t.status == "failed" for t in results),
        num_missing=num_missing,
        avg_length=sum(t.num_generated_tokens for t in results) / len(results) if results else 0.0,
        duration_s=duration_s,
        pass_k=pass_k,
        pass_all_k=pass_all_k,
        env={name: v / len(results) for name, v in sorted(sums.items())},
    )

"""Validation runs: issue one task per validation prompt with the validation sampling profile,
collect the scored trajectories, report accuracy (mean reward).

The runtime pauses training-task issue and drains in-flight training rollouts (with a deadline)
before calling `run`, and resumes afterwards. Validation trajectories arrive on the same stream as
training ones (``kind == "validation"``); the runtime's consumer hands them to `deliver`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from shared.protocol import SamplingParams, Task, Trajectory
from shared.streams import StreamClient

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
    ) -> None:
        self.streams = streams
        self.rows = rows[: max_samples or len(rows)]
        self.sampling = sampling
        self.default_env = default_env
        self.rollout_timeout_s = rollout_timeout_s
        self._results: dict[str, Trajectory] = {}
        self._expected: set[str] = set()
        self._arrived = asyncio.Event()

    def deliver(self, traj: Trajectory) -> None:
        if traj.group_id in self._expected:
            self._results[traj.group_id] = traj
            self._arrived.set()
        else:
            log.warning("validation trajectory %s belongs to no running validation; dropped", traj.task_id)

    async def run(self, step: int, validation_id: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        tasks = []
        for i, row in enumerate(self.rows):
            gid = f"{validation_id}-{i:05d}"
            tasks.append(
                Task(
                    task_id=f"{gid}/0", group_id=gid, index_in_group=0, group_size=1, prompt_index=i,
                    env=row.get("env", self.default_env), instance=row.get("instance", row), kind="validation",
                    target_step=step, sampling=self.sampling, deadline_s=self.rollout_timeout_s,
                )
            )
        self._expected = {t.group_id for t in tasks}
        self._results = {}
        await self.streams.publish_many(self.streams.keys.tasks, tasks)
        deadline = time.monotonic() + self.rollout_timeout_s
        while len(self._results) < len(tasks) and time.monotonic() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        missing = len(tasks) - len(self._results)
        if missing:
            log.error("validation %s: %d of %d rollouts missing at the deadline", validation_id, missing, len(tasks))
        rewards = [t.reward for t in self._results.values()]
        self._expected = set()
        return {
            "kind": "validation",
            "validation_id": validation_id,
            "step": step,
            "accuracy": sum(rewards) / len(rewards) if rewards else 0.0,
            "num_samples": len(rewards),
            "num_missing": missing,
            "num_failed": sum(t.status == "failed" for t in self._results.values()),
            "total_validation_time": time.perf_counter() - t0,
        }

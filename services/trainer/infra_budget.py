"""The budget of rollouts failed for an infrastructure reason (``grpo.max_infra_failure_fraction``).

With ``env.failure_policy: backfill`` a rollout that failed for an infrastructure reason (sandbox,
timeout, transport, no generator) is trained as a zero-token placeholder: out of the loss and the
baselines, never a reward of 0. A run in which most rollouts fail would still train on the few
that survive, biased towards whatever survives the failure. So the control plane feeds every
step's trajectories to `InfraFailureBudget` before training it; over the last
``grpo.infra_failure_window_steps`` steps (this one included), once the share of failed rollouts
exceeds the bound, the run pauses (`shared.pause.PauseReason.INFRA`) with the failure classes and
counts as its reason, instead of training. ``streamrl resume`` ends the pause; the held step is
then trained and a new window begins. The window is the control plane's and starts empty when
the trainer starts.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.trainer.buffer import is_placeholder
from shared.pause import PauseControl, PauseReason
from shared.protocol import Trajectory

log = logging.getLogger(__name__)


@dataclass
class _Step:
    step: int
    rollouts: int
    failed: int
    by_reason: Counter[str] = field(default_factory=Counter)


def failure_class(traj: Trajectory) -> str:
    """The class of an infrastructure failure: the head of its fallback reason (``transport``,
    ``sandbox``, ``timeout``, ``no_generator``, ...)."""
    return (traj.fallback_reason or "unknown").split(":", 1)[0]


class InfraFailureBudget:
    def __init__(self, max_fraction: float | None, window_steps: int) -> None:
        self.max_fraction = max_fraction
        self.window: deque[_Step] = deque(maxlen=window_steps)
        self.detail: str | None = None  # why the run is paused, while it is (for /status)

    async def enforce(
        self, step: int, trajs: list[Trajectory], pause: PauseControl, hold: Callable[[], Awaitable[None]]
    ) -> float:
        """Count ``step``'s rollouts; over the bound, pause the run (reason infra_failures, named in
        ``detail`` and the log), ``hold`` it until the resume, then start a new window. The failed
        share over the window, as it stood for this step."""
        share = self.observe(step, trajs, [t for t in trajs if is_placeholder(t)])
        reason = self.exceeded()
        if reason is not None:
            log.error("step %d: %s", step, reason)
            self.detail = reason
            await pause.pause(PauseReason.INFRA)
            await hold()
            self.detail = None
            self.reset()
        return share

    def observe(self, step: int, trajs: list[Trajectory], failed: list[Trajectory]) -> float:
        """Add ``step``'s rollouts (``failed``: those of them that failed for an infrastructure
        reason); the failed share over the window."""
        self.window.append(_Step(step, len(trajs), len(failed), Counter(failure_class(t) for t in failed)))
        return self.fraction()

    def fraction(self) -> float:
        rollouts = sum(s.rollouts for s in self.window)
        return sum(s.failed for s in self.window) / rollouts if rollouts else 0.0

    def exceeded(self) -> str | None:
        """Why the run must pause (the share, the steps, the failure classes and counts), or None
        while the window is within the bound."""
        if self.max_fraction is None or not self.window or self.fraction() <= self.max_fraction:
            return None
        failed = sum(s.failed for s in self.window)
        rollouts = sum(s.rollouts for s in self.window)
        classes = sum((s.by_reason for s in self.window), Counter())
        named = ", ".join(f"{reason}: {n}" for reason, n in classes.most_common())
        first, last = self.window[0].step, self.window[-1].step
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        return (
            f"{failed} of {rollouts} rollouts of {steps} failed for an infrastructure reason ({named}): "
            f"{self.fraction():.1%} is over grpo.max_infra_failure_fraction {self.max_fraction}; the run is paused "
            "before training on the rest (fix the cause, then `streamrl resume`)"
        )

    def reset(self) -> None:
        """A new window (after a resume: the failures that paused the run are not counted again)."""
        self.window.clear()

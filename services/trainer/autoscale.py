"""The autoscaler's policy: from what a step waited for, and why, to worker counts. Pure: no Redis,
no backend (`services.trainer.autoscaler` feeds it and carries out its decisions).

Each step ends with `Signals`: the fraction of the step the trainer waited for data (the one figure
that says the run is starved), and, averaged over the step, what says where the rollouts queue:
the tasks stream's lag (tasks no gateway worker has taken: gateway slots are short), the gateway
slots' busy fraction, and the requests waiting in the generators' engines. Then, per role:

    starved (the mean wait of the last up_after_steps steps > scale_up_wait_fraction; a mean,
      because an asynchronous run that is short of rollouts often alternates a long wait with a
      step whose batch was already staged) -> scale up the bottleneck, from the same steps' means:
        requests wait in the engines                 -> generators
        tasks wait for a slot, or the slots are full -> gateway workers
        neither                                      -> generators (generation is what takes time)
      by the factor that would have removed the wait: a step of period T that waited w.T needs its
      rollouts 1 / (1 - w) faster, so n -> ceil(n / (1 - w)); for gateways, at least as many more
      as the waiting tasks need slots (the wait understates the shortfall while the buffer still
      holds batches the window staged earlier); at least n + 1, at most max
    fed (every one of the last down_after_steps steps waited < scale_down_wait_fraction) -> one
      worker less, of a role that has slack: gateways when no task waits and the remaining slots
      would stay below max_gateway_utilization busy; generators when no request waits in their
      engines; never to a count that starved the trainer in the last starved_memory_steps steps
    a degraded generator -> one generator more (its replacement), within max

A scale-up is a trial: judged on the steps after it, one that left no work queued for its role and
yet did not cut the wait by a fifth is undone, and that role is not scaled past that count again
while the wait stays what it was (a wait more workers cannot remove: the staleness window, the
training time, another role).

Hysteresis: the two thresholds are apart; a scale-up or -down forgets the steps before it, so the
next decision judges the new counts at work; a role changes at most once every cooldown_steps
steps; and a count that starved the run is remembered. Decisions are taken
only when the trainer is neither refitting nor validating (the driver holds them until then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.sections.autoscale import ROLES, AutoscaleSection, RoleBounds

REPLACE = "replacing"  # how a replacement's reason starts

# A scale-up helped when the wait after it is below this fraction of the wait before it.
HELPED = 0.8

# Gateway slots this busy or more count as full (a task then waits for a slot even with no lag).
FULL_SLOTS = 0.95


@dataclass(frozen=True)
class Signals:
    """What one step tells the policy; means over the step unless said otherwise."""

    step: int
    wait_fraction: float  # of the step's time, waiting for data
    counts: dict[str, int]  # workers per role now (the backend's ready count)
    tasks_lag: float = 0.0  # tasks no gateway worker has taken yet
    gateway_utilization: float = 0.0  # busy rollout slots / slots
    generator_queue: float = 0.0  # requests waiting in the engines, per generator
    staleness_mean: float = 0.0  # of the step's trajectories (record only)
    degraded_generators: int = 0  # generators the fleet health calls degraded (now)
    gateway_slots: int = 0  # rollout slots of one gateway worker (gym_gateway.max_concurrent_rollouts)

    def as_dict(self) -> dict[str, float]:
        return {
            "wait_fraction": round(self.wait_fraction, 4),
            "tasks_lag": round(self.tasks_lag, 2),
            "gateway_utilization": round(self.gateway_utilization, 4),
            "generator_queue": round(self.generator_queue, 2),
            "staleness_mean": round(self.staleness_mean, 3),
            "degraded_generators": float(self.degraded_generators),
            **{f"{role}_count": float(n) for role, n in self.counts.items()},
        }


def window(steps: list[Signals]) -> Signals:
    """The means of ``steps``' figures, as the last step's signals (its step, counts, degraded)."""
    n, last = len(steps), steps[-1]

    def mean(name: str) -> float:
        return sum(float(getattr(x, name)) for x in steps) / n

    return Signals(
        step=last.step,
        wait_fraction=mean("wait_fraction"),
        counts=last.counts,
        tasks_lag=mean("tasks_lag"),
        gateway_utilization=mean("gateway_utilization"),
        generator_queue=mean("generator_queue"),
        staleness_mean=mean("staleness_mean"),
        degraded_generators=last.degraded_generators,
        gateway_slots=last.gateway_slots,
    )


@dataclass(frozen=True)
class Trial:
    """A scale-up of ``role`` from ``before`` to ``after`` at ``step``, decided at ``wait_before``."""

    role: str
    before: int
    after: int
    wait_before: float
    step: int


@dataclass(frozen=True)
class Decision:
    role: str  # generator | gym_gateway
    before: int
    after: int
    reason: str
    basis: Signals  # what it was decided from: the means over the steps the reason names


@dataclass
class AutoscalePolicy:
    cfg: AutoscaleSection
    history: list[Signals] = field(default_factory=list)  # the steps since the last scale-up or -down
    changed_at: dict[str, int] = field(default_factory=dict)  # role -> step of its last change
    starved_at: dict[tuple[str, int], int] = field(default_factory=dict)  # (role, count) -> last step starved
    serving_target: int | None = None  # generators the policy wants serving (degraded ones not counted)
    trial: Trial | None = None  # the last scale-up, until the steps after it show whether it helped
    ceiling: dict[str, Trial] = field(default_factory=dict)  # role -> a scale-up that did not help

    def bounds(self, role: str) -> RoleBounds:
        b: RoleBounds = getattr(self.cfg, role)
        return b

    def decide(self, s: Signals) -> list[Decision]:
        """The step's decisions (none most steps), at most one per role."""
        c = self.cfg
        self.history.append(s)
        if self.serving_target is None:
            self.serving_target = s.counts.get("generator", 0)
        up = window(self.history[-c.up_after_steps :])
        starved = len(self.history) >= c.up_after_steps and up.wait_fraction > c.scale_up_wait_fraction
        down = self.history[-c.down_after_steps :]
        fed = (
            len(self.history) >= c.down_after_steps and max(x.wait_fraction for x in down) < c.scale_down_wait_fraction
        )
        if starved:
            for role in ROLES:
                self.starved_at[(role, s.counts.get(role, 0))] = s.step
        decisions: list[Decision] = []
        # A scale-up is judged on the up_after_steps steps after the first one at the new count
        # (that one still ran on rollouts the old count started); until then nothing scales up.
        judging = self.trial is not None and len(self.history) <= c.up_after_steps
        undo = None
        if self.trial is not None and not judging:
            undo = self._judge_trial(window(self.history[1:][-c.up_after_steps :]))
        if undo is not None:
            decisions.append(undo)
        elif starved and not judging and (scale_up := self._scale_up(up)) is not None:
            decisions.append(scale_up)
            self.trial = Trial(scale_up.role, scale_up.before, scale_up.after, up.wait_fraction, s.step)
        elif fed:
            decisions += [d for role in ROLES if (d := self._scale_down(role, window(down))) is not None]
        if decisions:
            self.history = []  # the next decision sees the new counts at work
        if s.degraded_generators and not any(d.role == "generator" for d in decisions):
            replace = self._replace_degraded(s)
            if replace is not None:
                decisions.append(replace)
        for d in decisions:
            self.changed_at[d.role] = s.step
            if d.role == "generator" and not d.reason.startswith(REPLACE):
                self.serving_target = d.after - s.degraded_generators
        return decisions

    def _cooling(self, role: str, step: int) -> bool:
        last = self.changed_at.get(role)
        return last is not None and step - last < self.cfg.cooldown_steps

    def bottleneck(self, s: Signals) -> tuple[str, str]:
        """The role whose shortage made the trainer wait, and the evidence."""
        if s.generator_queue >= 1.0:
            return "generator", f"{s.generator_queue:.1f} requests waiting per generator"
        if s.tasks_lag >= 1.0:
            return "gym_gateway", f"{s.tasks_lag:.1f} tasks waiting for a gateway slot"
        if s.gateway_utilization >= FULL_SLOTS:
            return "gym_gateway", f"gateway slots {s.gateway_utilization:.0%} busy"
        return "generator", "no task or request queued outside the engines: generation is the bottleneck"

    def _judge_trial(self, s: Signals) -> Decision | None:
        """The last scale-up, judged on the steps after it: one that left no work queued for its
        role and yet did not cut the wait by a fifth (HELPED) is undone, and the role is not scaled
        past that count again while the wait stays what it was (`_capped`): the wait is one more
        workers of that role cannot remove. While work still queues for the role, it was too
        small rather than useless, and the next starved decision goes on."""
        t, self.trial = self.trial, None
        if t is None or s.counts.get(t.role, 0) != t.after or s.wait_fraction < HELPED * t.wait_before:
            return None
        queued = s.generator_queue >= 1.0 if t.role == "generator" else s.tasks_lag >= 1.0
        if queued or (t.role == "gym_gateway" and s.gateway_utilization >= FULL_SLOTS):
            return None
        self.ceiling[t.role] = Trial(t.role, t.before, t.after, s.wait_fraction, s.step)
        reason = (
            f"undo: {t.before} -> {t.after} did not shorten the wait ({t.wait_before:.0%} of a step before, "
            f"{s.wait_fraction:.0%} after): more {t.role} workers do not help here"
        )
        return Decision(t.role, t.after, t.before, reason, s)

    def _capped(self, role: str, n: int, s: Signals) -> bool:
        """A scale-up of ``role`` from ``n`` is known not to help: it did not, within
        starved_memory_steps, at a wait not much below today's."""
        cap = self.ceiling.get(role)
        if cap is None or s.step - cap.step > self.cfg.starved_memory_steps or s.wait_fraction > 1.5 * cap.wait_before:
            return False
        return n >= cap.before

    def _scale_up(self, s: Signals) -> Decision | None:
        role, evidence = self.bottleneck(s)
        n, top = s.counts.get(role, 0), self.bounds(role).max
        if n < 1 or n >= top or self._cooling(role, s.step) or self._capped(role, n, s):
            return None
        wanted, how = math.ceil(n / max(1.0 - s.wait_fraction, 0.5)), "to cover the wait"  # at most 2n
        if role == "gym_gateway" and s.gateway_slots and s.tasks_lag >= 1.0:
            for_tasks = n + math.ceil(s.tasks_lag / s.gateway_slots)
            if for_tasks > wanted:
                wanted, how = for_tasks, f"slots for the waiting tasks ({s.gateway_slots} a worker)"
        after = min(top, max(n + 1, wanted))
        steps = self.cfg.up_after_steps
        reason = (
            f"starved: waited {s.wait_fraction:.0%} of the last {steps} step{'s' if steps > 1 else ''} "
            f"(to step {s.step}); {evidence}; {n} -> {after}: {how}"
        )
        return Decision(role, n, after, reason, s)

    def _scale_down(self, role: str, s: Signals) -> Decision | None:
        n, b = s.counts.get(role, 0), self.bounds(role)
        if n <= b.min or self._cooling(role, s.step):
            return None
        last_starved = self.starved_at.get((role, n - 1))
        if last_starved is not None and s.step - last_starved <= self.cfg.starved_memory_steps:
            return None
        if role == "gym_gateway":
            projected = s.gateway_utilization * n / (n - 1)
            if s.tasks_lag >= 1.0 or projected >= self.cfg.max_gateway_utilization:
                return None
            slack = f"the other {n - 1} would be {projected:.0%} busy"
        else:
            if s.generator_queue > 0.0 or s.degraded_generators:
                return None
            slack = "no request waited in the engines"
        reason = (
            f"fed: waited under {self.cfg.scale_down_wait_fraction:.0%} in each of the last "
            f"{self.cfg.down_after_steps} steps (to step {s.step}); {slack}"
        )
        return Decision(role, n, n - 1, reason, s)

    def _replace_degraded(self, s: Signals) -> Decision | None:
        """Degraded generators get no new sessions: as many more as keep ``serving_target`` serving."""
        n, top = s.counts.get("generator", 0), self.bounds("generator").max
        target = self.serving_target or 0
        if n - s.degraded_generators >= target or n >= top or self._cooling("generator", s.step):
            return None
        after = min(top, target + s.degraded_generators)
        reason = f"{REPLACE} {s.degraded_generators} degraded generator(s): they get no new sessions"
        return Decision("generator", n, after, reason, s)

"""The trainer's Prometheus metrics, served at ``GET /metrics``.

Three sources:
* each metrics record (train step or validation) as the runtime writes it: `observe_record` is a
  record sink, so the staleness histogram (one observation per consumed trajectory: step minus
  the weight version it was launched on), refit phase and step phase durations are observed
  exactly once per step;
* the runtime's live state, read at scrape time (step, version, buffer, in-flight groups);
* Redis, read at scrape time: every stream's length, pending entries per consumer group and per
  consumer (`shared.queue_stats`).

Built by the trainer app; `staleness_counts` is also called by the runtime for the step record.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import ServiceMetrics
from shared.queue_stats import group_stats, stream_lengths

log = logging.getLogger(__name__)

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
REFIT_PHASES = ("write", "checksum", "confirm")
STEP_PHASES = {"wait_data": "time_wait_data_s", "train": "time_train_s", "refit": "time_refit_s", "step": "time_step_s"}


def staleness_counts(step: int, groups: Iterable[Any]) -> dict[str, int]:
    """{age: trajectories} for a step's groups; age = step - launch version of each trajectory
    (rows that never reached a generator have no version and are left out)."""
    counts: dict[str, int] = {}
    for g in groups:
        for t in g.rows.values():
            if t.launch_version >= 0:
                age = str(step - t.launch_version)
                counts[age] = counts.get(age, 0) + 1
    return counts


class TrainerMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("trainer")
        r = self.registry
        self.step = Gauge("streamrl_trainer_step", "Current training step", registry=r)
        self.version = Gauge("streamrl_trainer_weight_version", "Last confirmed weight version", registry=r)
        self.buffer = Gauge(
            "streamrl_trainer_buffer_groups", "Complete groups staged, by target offset", ["offset"], registry=r
        )
        self.in_flight = Gauge("streamrl_trainer_in_flight_groups", "Groups issued and not yet complete", registry=r)
        self.evicted = Gauge("streamrl_trainer_evicted_groups_total", "Groups evicted as stale", registry=r)
        self.reward = Gauge("streamrl_trainer_reward_mean", "Mean reward of the last step", registry=r)
        self.staleness_mean = Gauge("streamrl_trainer_staleness_mean", "Mean age of the last step's groups", registry=r)
        self.refit = Gauge("streamrl_trainer_refit_seconds", "Duration of the last refit", registry=r)
        self.deadletter = Gauge(
            "streamrl_trainer_deadlettered_total", "Entries dead-lettered by the trainer", registry=r
        )
        self.val_accuracy = Gauge("streamrl_trainer_validation_accuracy", "Accuracy of the last validation", registry=r)
        self.staleness = Histogram(
            "streamrl_trainer_trajectory_staleness_steps",
            "Per consumed trajectory: training step minus the weight version it was launched on",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.refit_phase = Histogram(
            "streamrl_trainer_refit_phase_seconds",
            "Refit duration per phase (write, checksum, confirm)",
            ["phase"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.step_phase = Histogram(
            "streamrl_trainer_step_phase_seconds",
            "Training step duration per phase (wait_data, train, refit, step)",
            ["phase"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.refit_generators = Gauge(
            "streamrl_trainer_refit_generators", "Generators that confirmed the last refit", registry=r
        )
        self.refit_dropped = Counter(
            "streamrl_trainer_refit_dropped_generators",
            "Generators that left or began draining during a refit",
            registry=r,
        )
        self.stream_length = Gauge("streamrl_stream_length", "Entries in a stream of the run", ["stream"], registry=r)
        self.group_pending = Gauge(
            "streamrl_stream_pending",
            "Entries delivered to a consumer group and not yet acked",
            ["stream", "group"],
            registry=r,
        )
        self.group_lag = Gauge(
            "streamrl_stream_lag", "Entries not yet delivered to a consumer group", ["stream", "group"], registry=r
        )
        self.consumer_pending = Gauge(
            "streamrl_consumer_pending", "Pending entries per consumer", ["stream", "group", "consumer"], registry=r
        )
        self.consumer_idle = Gauge(
            "streamrl_consumer_idle_seconds",
            "Time since a consumer last read",
            ["stream", "group", "consumer"],
            registry=r,
        )

    def observe_record(self, record: dict[str, Any]) -> None:
        """Record sink: one call per line written to metrics.jsonl."""
        if record.get("kind") == "validation":
            if "accuracy" in record:
                self.val_accuracy.set(float(record["accuracy"]))
            return
        for age, n in (record.get("staleness_counts") or {}).items():
            for _ in range(int(n)):
                self.staleness.observe(float(age))
        for phase in REFIT_PHASES:
            value = record.get(f"time_refit_{phase}_s")
            if value is not None:
                self.refit_phase.labels(phase=phase).observe(float(value))
        for phase, key in STEP_PHASES.items():
            if record.get(key) is not None:
                self.step_phase.labels(phase=phase).observe(float(record[key]))
        if "refit_generators" in record:
            self.refit_generators.set(len(record["refit_generators"]))
            self.refit_dropped.inc(len(record.get("refit_dropped_generators") or []))

    def update_from_runtime(self, rt) -> None:
        self.step.set(rt.step)
        self.version.set(rt.weight_version)
        if not hasattr(rt, "buffer"):
            return
        self.buffer.clear()
        for target, n in rt.buffer.depth_by_target().items():
            self.buffer.labels(offset=str(target - rt.step)).set(n)
        self.in_flight.set(rt.scheduler.in_flight_count())
        self.evicted.set(rt.buffer.evicted_total)
        self.deadletter.set(rt.streams.deadlettered)
        last = rt.last_metrics
        if last:
            self.reward.set(last["reward_mean"])
            self.staleness_mean.set(last["staleness_mean"])
            self.refit.set(last["time_refit_s"])

    async def update_from_redis(self, redis, keys) -> None:
        """Stream lengths and pending entries; a Redis error leaves the last values (and is logged)."""
        try:
            lengths = await stream_lengths(redis, keys)
            groups = await group_stats(redis, keys)
        except Exception as exc:
            log.warning("queue metrics unavailable: %s: %s", type(exc).__name__, exc)
            return
        for name, n in lengths.items():
            self.stream_length.labels(stream=name).set(n)
        self.consumer_pending.clear()
        self.consumer_idle.clear()
        for g in groups:
            self.group_pending.labels(stream=g.stream, group=g.group).set(g.pending)
            if g.lag is not None:
                self.group_lag.labels(stream=g.stream, group=g.group).set(g.lag)
            for c in g.consumers:
                self.consumer_pending.labels(stream=g.stream, group=g.group, consumer=c.name).set(c.pending)
                self.consumer_idle.labels(stream=g.stream, group=g.group, consumer=c.name).set(c.idle_s)

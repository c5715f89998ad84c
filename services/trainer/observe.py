"""The trainer's Prometheus metrics, served at ``GET /metrics``.

Three sources:
* each record (train step, validation or autoscaler decision) as the control plane writes it: `observe_record` is a
  record sink, so the staleness histogram (one observation per consumed trajectory: step minus
  the weight version it was launched on), refit phase and step phase durations are observed
  exactly once per step, and the last step's reward, staleness and refit time are kept, as are
  its figures under NeMo-RL's names (``streamrl_trainer_nemo_rl{name="timing/train/total_step_time"}``:
  Prometheus names cannot hold NeMo-RL's, so a label does);
* the control plane's live state, read at scrape time (step, version, buffer, in-flight groups);
* Redis, read at scrape time: every stream's length, pending entries per consumer group and per
  consumer (`shared.queue_stats`).

Built by the trainer app (`services.trainer.app`).
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from services.trainer.buffer import ReplayBuffer
from services.trainer.scheduler import Scheduler
from shared import keys as K
from shared.metrics import ServiceMetrics
from shared.queue_stats import group_stats, stream_lengths
from shared.records import AutoscaleRecord, Record, ValidationRecord
from shared.streams import StreamClient

log = logging.getLogger(__name__)

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class ControlView(Protocol):
    """What the metrics read of the control plane at scrape time."""

    step: int
    weight_version: int
    buffer: ReplayBuffer
    scheduler: Scheduler
    streams: StreamClient


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
        self.autoscale_decisions = Counter(
            "streamrl_autoscale_decisions",
            "Autoscaler decisions by role, direction and outcome",
            ["role", "direction", "outcome"],
            registry=r,
        )
        self.autoscale_workers = Gauge(
            "streamrl_autoscale_workers", "Workers of a role after the autoscaler's last decision", ["role"], registry=r
        )
        self.nemo_rl = Gauge(
            "streamrl_trainer_nemo_rl", "The last step's figures under NeMo-RL's names", ["name"], registry=r
        )
        self.learner = Gauge(
            "streamrl_trainer_learner",
            "The last step's learner figures (loss, grad_norm, the trainer/generator divergences, probs_ratio, ...)",
            ["name"],
            registry=r,
        )
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

    def observe_record(self, record: Record) -> None:
        """Record sink: one call per line written to metrics.jsonl."""
        if isinstance(record, ValidationRecord):
            self.val_accuracy.set(record.accuracy)
            return
        if isinstance(record, AutoscaleRecord):
            direction = "up" if record.after > record.before else "down"
            self.autoscale_decisions.labels(role=record.role, direction=direction, outcome=record.outcome).inc()
            if record.outcome == "done":
                self.autoscale_workers.labels(role=record.role).set(record.after)
            return
        for age, n in record.staleness.counts.items():
            for _ in range(n):
                self.staleness.observe(float(age))
        refit = record.refit
        for phase, seconds in (("write", refit.write_s), ("checksum", refit.checksum_s), ("confirm", refit.confirm_s)):
            self.refit_phase.labels(phase=phase).observe(seconds)
        t = record.timing
        for phase, seconds in (
            ("wait_data", t.wait_data_s),
            ("train", t.train_s),
            ("refit", refit.total_s),
            ("step", t.step_s),
        ):
            self.step_phase.labels(phase=phase).observe(seconds)
        self.refit_generators.set(len(refit.generators))
        self.refit_dropped.inc(len(refit.dropped_generators))
        self.reward.set(record.batch.reward_mean)
        self.staleness_mean.set(record.staleness.mean)
        self.refit.set(refit.total_s)
        if record.nemo_rl is not None:
            for name, value in record.nemo_rl.named().items():
                self.nemo_rl.labels(name=name).set(value)
        for name, value in msgspec.structs.asdict(record.learner).items():
            if isinstance(value, int | float) and not isinstance(value, bool):  # None: not measured this step
                self.learner.labels(name=name).set(value)

    def update_from_control(self, control: ControlView) -> None:
        """The control plane's live state, read at scrape time."""
        self.step.set(control.step)
        self.version.set(control.weight_version)
        self.buffer.clear()
        for target, n in control.buffer.depth_by_target().items():
            self.buffer.labels(offset=str(target - control.step)).set(n)
        self.in_flight.set(control.scheduler.in_flight_count())
        self.evicted.set(control.buffer.evicted_total)
        self.deadletter.set(control.streams.deadlettered)

    async def update_from_redis(self, redis: aioredis.Redis, keys: K.RunKeys) -> None:
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

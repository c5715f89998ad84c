"""The trainer's control plane: the asynchronous GRPO loop around a learner.

It owns Redis, the scheduler, the replay buffer, the trajectory intake, validation, refit
coordination, checkpoints with their acknowledgements, and the metrics records; the learner
(`services.trainer.learner`) owns the model. In a trainer of many ranks only rank 0 runs this.

    open:  consumer groups, incarnation -> learner.start (loads the policy) -> restore the newest
           checkpoint -> heartbeat
    run:   initial refit: publish v0, every generator confirms (collection starts only after it)
           -> [hold while paused] -> [validation at start] -> issue tasks -> lookahead barrier:
              complete batches staged for targets s0 and s0+1
           -> step s, until grpo.max_num_steps or an early stop:
                hold while paused -> top up tasks for targets [s, s+L] -> wait for N usable groups
                (stale ones evicted, their prompts reused; with dynamic sampling, groups whose
                rewards all tie filtered and replaced) -> batch -> learner.train -> refit to
                v=s+1 -> checkpoint, then ack what it made durable -> record -> validations due
                -> the autoscaler's decision (`autoscaler`, with autoscale.enabled)
           -> end: hold while paused -> validations still queued -> [validation at end] -> stop key
    close: intake stopped, records closed and plotted, heartbeat removed, Redis closed

A user pause (POST /pause) holds the run at the next step boundary, the last one included, and
the data deadline (``trainer.data_timeout_s``) does not run while the run is paused. Any failure
(a fail-fast rollout, a dead intake, Redis gone, a refit no generator confirms) fails the run
loudly: the state, the heartbeat and the stop key say so, and `run` raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.trainer.autoscaler import Autoscaler
from services.trainer.batch import StepBatch, build_step_batch
from services.trainer.buffer import ReplayBuffer, SampleResult
from services.trainer.checkpoint import Checkpointer, ControlState, checkpoint_meta
from services.trainer.collection import Collector
from services.trainer.infra_budget import InfraFailureBudget
from services.trainer.intake import TrajectoryIntake
from services.trainer.learner import Learner, LearnerLost
from services.trainer.metrics_log import MetricsLog, RecordSink, plot_reward_curve
from services.trainer.nemo_rl_metrics import nemo_rl_metrics
from services.trainer.ranks import launched_world_size
from services.trainer.refit import RefitReport, WeightPublisher, check_refit_fidelity
from services.trainer.refit_probe import build_probe
from services.trainer.reward_shaping import OverlongPenalty
from services.trainer.scheduler import Scheduler
from services.trainer.status_view import trainer_status
from services.trainer.step_record import PipelineMeter, StepClock, build_step_record
from services.trainer.validation import ValidationRunner
from services.trainer.validation_control import ValidationController
from services.trainer.weight_transport import build_transport
from shared import keys as K
from shared.pause import PauseControl
from shared.protocol import Heartbeat, Task, Trajectory
from shared.records import (
    LearnerMetrics,
    StepRecord,
    TrainerState,
    TrainerStatus,
    ValidationRecord,
    read_records,
)
from shared.registry import HeartbeatTask
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect

log = logging.getLogger(__name__)

CONSUMER = "trainer"


@dataclass
class TrainerHooks:
    """Observers a caller plugs into the control plane (benchmarks, tests, the Prometheus
    metrics); each is called synchronously on the event loop and must not block."""

    tasks_issued: Callable[[list[Task]], None] | None = None  # after each publish of training tasks
    trajectory_read: Callable[[Trajectory], None] | None = None  # every trajectory the intake reads
    record_sinks: list[RecordSink] = field(default_factory=list)  # every record written


class ControlPlane:
    def __init__(
        self, cfg: RunConfig, learner: Learner, *, worker_id: str, url: str, hooks: TrainerHooks | None = None
    ) -> None:
        g, out = cfg.grpo, Path(cfg.run.output_dir)
        self.cfg = cfg
        self.learner = learner
        self.worker_id = worker_id
        self.url = url
        self.hooks = hooks if hooks is not None else TrainerHooks()
        self.keys = K.RunKeys(cfg.run.run_id)
        self.redis = connect(cfg.redis.url or "redis://127.0.0.1:6379/0")
        self.streams = StreamClient(self.redis, self.keys, CONSUMER)
        self.pause = PauseControl(self.redis, self.keys)
        self.buffer = ReplayBuffer.from_config(cfg)
        self.scheduler = Scheduler.from_config(cfg)
        runner = ValidationRunner.from_config(cfg, self.streams)
        self.checkpointer = Checkpointer(
            cfg.checkpointing,
            Path(cfg.checkpointing.checkpoint_dir or out / "checkpoints"),
            self.streams,
            learner,
            max_num_steps=g.max_num_steps,
            stream_retention_s=cfg.trainer.stream_retention_s,
        )
        self.intake = TrajectoryIntake(
            self.streams,
            self.buffer,
            self.scheduler,
            cfg.env,
            deliver_validation=runner.deliver if runner else _no_validation,
            hold_acks=self.checkpointer.hold,
            observe=self.hooks.trajectory_read,
        )
        self.collector = Collector(
            cfg,
            self.streams,
            self.scheduler,
            self.buffer,
            self.intake,
            self.pause,
            hold_acks=self.checkpointer.hold,
            tasks_issued=self.hooks.tasks_issued,
        )
        self.log_dir = Path(cfg.logger.log_dir or out)
        self.metrics = MetricsLog(
            self.log_dir / "metrics.jsonl",
            sinks=self.hooks.record_sinks,
            tensorboard_dir=self.log_dir / "tensorboard" if cfg.logger.tensorboard else None,
        )
        self.validation = ValidationController(
            cfg,
            runner,
            pause=self.pause,
            scheduler=self.scheduler,
            buffer=self.buffer,
            intake=self.intake,
            write_record=self.metrics.write,
        )
        self.publisher = WeightPublisher(
            self.streams,
            self.pause,
            build_transport(cfg, learner, out / "weights", self.redis, self.keys),
            timeout_s=cfg.trainer.refit_timeout_s,
            in_flight_updates=g.async_grpo.in_flight_weight_updates,
            max_attempts=cfg.refit.max_attempts,
            probe=build_probe(cfg, learner.probe),
        )
        self.heartbeat = HeartbeatTask(self.redis, self.keys, self._heartbeat)
        self.pipeline = PipelineMeter(cfg, self.redis, self.keys, devices=launched_world_size())  # MFU, workers
        self.autoscaler = Autoscaler.from_config(
            cfg, self.redis, self.keys, write_record=self.metrics.write, busy=self._refitting_or_validating
        )
        self.state = TrainerState.STARTING
        self.error: str | None = None
        self.step = 0  # steps done
        self.weight_version = -1  # the last version every generator confirmed
        self._fidelity_checked = -1  # the newest version whose first step passed refit.max_gen_kl_error
        self.incarnation = 0
        self.early_stopped = False
        self.infra = InfraFailureBudget(cfg.grpo.max_infra_failure_fraction, cfg.grpo.infra_failure_window_steps)
        self.last_record: StepRecord | None = None
        self.started_at = time.time()

    # ---- open and close -----------------------------------------------------------------------

    async def open(self) -> None:
        if self.autoscaler is not None:  # refused before the policy loads when its backend cannot be had
            self.autoscaler.start()
        await self.streams.ensure_group(self.keys.tasks, K.GATEWAYS_GROUP)
        await self.streams.ensure_group(self.keys.trajectories, K.TRAINER_GROUP)
        await self.redis.delete(self.keys.stop)
        self.incarnation = int(await self.redis.incr(self.keys.trainer_incarnation))
        self.scheduler.set_incarnation(self.incarnation)
        if self.validation.runner is not None:
            self.validation.runner.set_incarnation(self.incarnation)
        self.state = TrainerState.LOADING_POLICY
        await self.learner.start()
        self.metrics.open()
        restored = await self.checkpointer.restore()
        if restored is not None:
            control, meta = restored
            self.scheduler.restore(control.scheduler)
            self.buffer.restore_consumed(set(control.consumed_ids))
            self.intake.cancel_groups(set(control.cancelled_groups))
            self.step = meta.step
        self.heartbeat.start()

    async def aclose(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.aclose()
        await _safe(self.publisher.transport.aclose())
        await _safe(self.learner.close())
        self.metrics.close()  # already closed when the loop ran (`_finish`); not when it never started
        await self.heartbeat.aclose(self.worker_id)
        await self.redis.aclose()

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            kind="trainer",
            url=self.url,
            state="failed" if self.error else "ready",
            weight_version=self.weight_version,
            started_at=self.started_at,
            stats={"step": float(self.step)},
            error=self.error,
        )

    # ---- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        self.intake.start()
        try:
            await self._start_up()
            while self.step < self.cfg.grpo.max_num_steps and not self.early_stopped:
                await self._step()
            await self._end()
        except asyncio.CancelledError:
            log.warning("trainer stopped at step %d", self.step)
            self.validation.close("the trainer was stopped")
            raise
        except Exception as exc:
            self.fail(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, LearnerLost):  # the trainer's own processes: a restart goes on with the run
                log.error("the run stays open for its workers: restart the trainer to resume from its checkpoint")
            else:
                await _safe(self.redis.set(self.keys.stop, b"failed"))
            raise
        finally:
            await self._finish()

    def fail(self, error: str) -> None:
        """Mark the run failed: the state, /status, the heartbeat (at once) and queued validations."""
        if self.error is None:
            self.state, self.error = TrainerState.FAILED, error
            log.error("run failed: %s", error)
        self.validation.close(f"the run failed: {error}")
        self.heartbeat.beat_now()

    async def _start_up(self) -> None:
        g = self.cfg.grpo
        await self._refit(self.step, initial=True)
        await self._hold_while_paused()
        if g.val_at_start and self.validation.runner is not None and self.step == 0:
            # Before any training task is issued; a hit of the stop metric ends the run here.
            if self.validation.stop_hit(await self._validate("val-start")):
                self.early_stopped = True
                return
        if self.step < g.max_num_steps:  # resumed from the final checkpoint: nothing to collect
            await self.collector.issue(self.step)
            self.state = TrainerState.COLLECTING
            await self.collector.lookahead_barrier(self.step, on_hold=self._collecting_held)

    async def _within_infra_budget(self, step: int, sample: SampleResult, batch: StepBatch) -> None:
        """Over the budget of infrastructure failures the run holds here (`infra_budget`)."""
        trajs = [t for g in sample.groups for t in g.ordered()]
        window = await self.infra.enforce(step, trajs, self.pause, self._hold_while_paused)
        if batch.stats is not None:
            batch.stats.infra_failure_fraction_window = window

    async def _train(self, step: int, batch: StepBatch) -> LearnerMetrics:
        """The learner's part of ``step``. A non-finite gradient's error (the backends'
        `NonFiniteGradient`, a FloatingPointError) is raised again naming the step: the run fails
        before the step's checkpoint, so the one before it stays the latest."""
        try:
            return await self.learner.train(batch)
        except FloatingPointError as exc:
            raise type(exc)(f"step {step}: {exc}") from exc

    async def _step(self) -> None:
        step = self.step
        await self._hold_while_paused()
        await self.collector.issue(step)  # top up the window (a pause may have held back the last top-up)
        t0 = time.perf_counter()
        self.state = TrainerState.COLLECTING
        sample = await self.collector.wait_for_batch(step, on_hold=self._collecting_held)
        t_data = time.perf_counter()
        self.state = TrainerState.TRAINING
        batch = self._batch(sample)
        await self._within_infra_budget(step, sample, batch)
        t_batch = time.perf_counter()
        learner_metrics = await self.collector.trained(step, sample, self._train(step, batch))
        self._check_refit_fidelity(learner_metrics)
        t_train = time.perf_counter()
        report = await self._refit(step + 1)
        self.step = step + 1
        await self.redis.set(self.keys.trainer_step, str(self.step))
        self.checkpointer.hold([e for g in sample.groups for e in g.entry_ids])
        t_save = time.perf_counter()
        saved = await self._checkpoint(force=False)
        clock = StepClock(t0, t_data, t_batch, t_train, checkpoint_s=time.perf_counter() - t_save)
        await self._write_step_record(step, sample, batch, learner_metrics, report, clock)
        await self._hold_while_paused()
        for vid in self.validation.due(self.step):  # on the weights just published
            if self.validation.stop_hit(await self._validate(vid)):
                self.early_stopped = True
                break
        if self.early_stopped and not saved:
            await self._checkpoint(force=True)
        if self.autoscaler is not None and self.last_record is not None:
            self.autoscaler.after_step(self.last_record)  # after the step's refit and validations

    def _check_refit_fidelity(self, metrics: LearnerMetrics) -> None:
        """The first step with rows generated wholly by the newest version checks their
        ``gen_kl_error`` (`services.trainer.refit.check_refit_fidelity`); fails the run loudly when
        it is too big."""
        bound, version = self.cfg.refit.max_gen_kl_error, self.weight_version
        if bound is None or version <= self._fidelity_checked or metrics.gen_kl_error_fresh is None:
            return
        self._fidelity_checked = version
        check_refit_fidelity(version, metrics.gen_kl_error_fresh, bound)

    def _batch(self, sample: SampleResult) -> StepBatch:
        cfg = self.cfg
        return build_step_batch(
            sample.groups,
            max_len=cfg.policy.max_total_sequence_length,
            leave_one_out=cfg.grpo.use_leave_one_out_baseline,
            normalize=cfg.grpo.normalize_rewards,
            mask_flagged=cfg.env.should_mask_flagged_samples,
            on_prefix_break=cfg.env.on_prefix_break,
            overlong_filtering=cfg.grpo.overlong_filtering,
            overlong_penalty=OverlongPenalty.from_config(cfg),
            trainer_version=self.weight_version,  # the learner holds the version every generator confirmed
        )

    async def _write_step_record(
        self,
        step: int,
        sample: SampleResult,
        batch: StepBatch,
        learner_metrics: LearnerMetrics,
        report: RefitReport,
        clock: StepClock,
    ) -> None:
        assert batch.stats is not None  # build_step_batch always fills it
        record = build_step_record(
            step,
            sample,
            batch.stats,
            learner_metrics,
            report,
            clock,
            buffer=self.buffer,
            scheduler=self.scheduler,
            evicted_ids=self.collector.evicted_ids,
            group_size=self.cfg.grpo.num_generations_per_prompt,
            received_total=self.intake.received_total,
            started_at=self.started_at,
            dynamic_sampling=self.collector.dynamic_sampling_stats(sample),
            pipeline=await self.pipeline.measure(batch, learner_metrics),
        )
        record.nemo_rl = nemo_rl_metrics(record, batch, sample.groups, trainer_ranks=launched_world_size())
        self.last_record = record
        self.metrics.write(record)

    async def _end(self) -> None:
        await self._hold_while_paused()  # the last boundary holds too: a paused run does not end
        for vid in self.validation.take_requested():  # requested before the end: on the final weights
            await self._validate(vid)
        last = self.validation.last
        if (
            self.cfg.grpo.val_at_end
            and self.validation.runner is not None
            and not self.early_stopped
            and not (last and last.step == self.step)
        ):
            await self._validate("val-end")
        self.validation.close("the run has finished")
        self.state = TrainerState.FINISHED
        await self.redis.set(self.keys.stop, b"finished")
        log.info("run finished after %d steps%s", self.step, " (early stop)" if self.early_stopped else "")

    async def _finish(self) -> None:
        # Trajectories trained since the last checkpoint stay unacknowledged (a run that ends has
        # none: its last step forces a checkpoint): a restart delivers them again.
        await self.intake.stop()
        self.metrics.close()
        if self.cfg.logger.plot:
            path = self.log_dir / "metrics.jsonl"
            title = f"run {self.cfg.run.run_id}"
            await asyncio.to_thread(
                lambda: plot_reward_curve(read_records(path), self.log_dir / "reward_curve.png", title)
            )

    def _refitting_or_validating(self) -> bool:
        return self.state in (TrainerState.REFIT, TrainerState.VALIDATING)

    def _collecting_held(self, held: bool) -> None:
        """A pause landed (or ended) while the step waits for its batch: the state says so."""
        self.state = TrainerState.PAUSED if held else TrainerState.COLLECTING

    async def _hold_while_paused(self) -> None:
        """A user pause holds the run here; the state says "paused" meanwhile."""
        resume_state = self.state
        await self.collector.hold_while_paused(lambda: setattr(self, "state", TrainerState.PAUSED))
        self.state = resume_state

    # ---- refit, checkpoints, validation ----------------------------------------------------------

    async def _refit(self, version: int, initial: bool = False) -> RefitReport:
        self.state = TrainerState.REFIT
        if initial:
            log.info("initial refit: publishing v%d before any task is issued", version)
        report = await self.publisher.refit(
            version, wait_for_generators_s=self.cfg.trainer.startup_timeout_s if initial else None
        )
        self.weight_version = version
        return report

    async def _checkpoint(self, *, force: bool) -> bool:
        control = ControlState(
            scheduler=self.scheduler.state(),
            consumed_ids=sorted(self.buffer.consumed_ids()),
            cancelled_groups=sorted(self.intake.cancelled_groups),
        )
        return await self.checkpointer.after_step(control, checkpoint_meta(self.step, self.weight_version), force=force)

    async def _validate(self, validation_id: str) -> ValidationRecord | None:
        resume_state, self.state = self.state, TrainerState.VALIDATING
        try:
            return await self.validation.run(validation_id, self.step)
        finally:
            self.state = resume_state

    # ---- status -------------------------------------------------------------------------------

    async def status(self) -> TrainerStatus:
        return await trainer_status(self)


def _no_validation(traj: Trajectory) -> None:
    log.warning("validation trajectory %s arrived, but this run has no validation data; dropped", traj.task_id)


async def _safe(coro: Awaitable[object]) -> None:
    try:
        await coro
    except Exception as exc:
        log.warning("ignored during shutdown: %s", exc)

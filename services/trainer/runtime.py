"""The trainer runtime: wires scheduler, replay buffer, learner, refit, validation, checkpoints
and metrics, and runs the asynchronous GRPO loop.

    start: load policy -> publish v0 -> every generator confirms -> [initial validation] -> issue
           tasks (collection starts only after the initial refit) -> lookahead barrier: wait for
           complete batches of targets s0 and s0+1
    step s: wait for N usable groups (buffer) -> advantages + loss + optimizer (thread) ->
            refit to v=s+1 -> checkpoint / ack -> log -> validations due at this boundary
            (periodic, or requested through POST /validate) -> top up tasks for [s+1, s+1+L]

Validation pauses task issue, drains in-flight training rollouts up to a deadline (then proceeds,
or cancels them: their prompts go back and their results are dropped), runs on the new weights,
and may stop the run early (grpo.stop_at_validation_metric; a final checkpoint is forced; a hit at
the initial validation returns before any training).

A background consumer moves trajectories from the stream into the buffer (or to a running
validation). Trajectory entries are acked once the step that used them is checkpointed (or when
they are evicted / duplicates), so a crash between checkpoints re-delivers them on restart. After
every step the tasks and trajectories streams are trimmed by acknowledged id (never an unacked
entry; trainer.stream_retention_s of acknowledged history stays), so they stay bounded.
Any background failure (a fail-fast rollout failure, a decode storm, Redis gone) fails the run
loudly instead of hanging it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from services.trainer.batch import build_step_batch
from services.trainer.buffer import ReplayBuffer
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.metrics_log import MetricsLog, RecordSink, plot_reward_curve, read_metrics
from services.trainer.observe import staleness_counts
from services.trainer.refit import WeightPublisher
from services.trainer.scheduler import PromptSource, Scheduler, _read_jsonl
from services.trainer.validation import ValidationRunner, periodic_due
from shared import keys as K
from shared.pause import PauseControl, PauseReason
from shared.protocol import Heartbeat, Trajectory
from shared.registry import HeartbeatTask, live_workers
from shared.run_config import RunConfig, backfills_failures
from shared.streams import StreamClient, connect

log = logging.getLogger(__name__)

CONSUMER = "trainer"


class RunFailed(RuntimeError):
    """The run cannot continue; the message says why."""


class TrainerRuntime:
    def __init__(self, cfg: RunConfig, *, worker_id: str, url: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.url = url
        out = Path(cfg.run.output_dir)
        self.weights_dir = out / "weights"
        self.ckpt_dir = Path(cfg.checkpointing.checkpoint_dir or out / "checkpoints")
        self.log_dir = Path(cfg.logger.log_dir or out)
        self.keys = K.RunKeys(cfg.run.run_id)
        self.step = 0
        self.weight_version = -1
        self.state = "starting"
        self.error: str | None = None
        self.last_metrics: dict[str, Any] = {}
        self.last_validation: dict[str, Any] | None = None
        self.validation_requests: list[str] = []
        self.validations: dict[str, dict[str, Any]] = {}  # id -> status and result (GET /validations/<id>)
        self.cancelled_groups: set[str] = set()
        self._step_evicted: list[str] = []  # task ids evicted while waiting for the current step
        self.cancelled_total = 0
        self.early_stopped = False
        self.started_at = time.time()
        self.trajectories_received = 0
        self._fatal: BaseException | None = None
        self._group_ready = asyncio.Event()
        self._unacked: list[str] = []
        self.record_sinks: list[RecordSink] = []  # called with every metrics record (Prometheus)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---- set-up -------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        self.redis = connect(cfg.redis.url or "redis://127.0.0.1:6379/0")
        self.streams = StreamClient(self.redis, self.keys, CONSUMER)
        await self.streams.ensure_group(self.keys.tasks, K.GATEWAYS_GROUP)
        await self.streams.ensure_group(self.keys.trajectories, K.TRAINER_GROUP)
        self.pause = PauseControl(self.redis, self.keys)
        await self.redis.delete(self.keys.stop)
        self.incarnation = int(await self.redis.incr(self.keys.trainer_incarnation))
        g = cfg.grpo
        self.buffer = ReplayBuffer(
            max_age=g.async_grpo.max_trajectory_age_steps, allow_future=g.async_grpo.allow_future_targets
        )
        self.scheduler = Scheduler(
            PromptSource(cfg.data.train_path, seed=cfg.run.seed, shuffle=cfg.data.shuffle),
            num_prompts_per_step=g.num_prompts_per_step,
            group_size=g.num_generations_per_prompt,
            max_age=g.async_grpo.max_trajectory_age_steps if g.async_grpo.enabled else 0,
            default_env=cfg.env.name,
            sampling=cfg.policy.generation.sampling("train"),
            rollout_timeout_s=cfg.gym_gateway.rollout_timeout_s,
        )
        self.scheduler.group_prefix = f"r{self.incarnation}-g"
        self.validator = None
        if cfg.data.val_path:
            self.validator = ValidationRunner(
                self.streams,
                _read_jsonl(cfg.data.val_path),
                sampling=cfg.policy.generation.sampling("validation"),
                default_env=cfg.env.name,
                max_samples=g.max_val_samples,
                rollout_timeout_s=cfg.gym_gateway.rollout_timeout_s,
                generations_per_prompt=g.val_num_generations_per_prompt,
                id_prefix=f"r{self.incarnation}-",
            )
        self.publisher = WeightPublisher(
            self.streams,
            self.pause,
            self.weights_dir,
            timeout_s=cfg.trainer.refit_timeout_s,
            in_flight_updates=g.async_grpo.in_flight_weight_updates,
        )
        self.state = "loading_policy"
        self.backend = await asyncio.to_thread(self._build_backend)
        self.metrics = MetricsLog(
            self.log_dir / "metrics.jsonl",
            sinks=self.record_sinks,
            tensorboard_dir=self.log_dir / "tensorboard" if cfg.logger.tensorboard else None,
        )
        await asyncio.to_thread(self._restore)
        self.heartbeat = HeartbeatTask(self.redis, self.keys, self._heartbeat)
        self.heartbeat.start()

    def _build_backend(self):
        if self.cfg.trainer.backend == "megatron":
            from services.trainer.backends.megatron_backend import MegatronBackend as Backend
        else:
            from services.trainer.backends.torch_backend import TorchBackend as Backend

        cfg = self.cfg
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        updates_per_step = rows // (cfg.policy.train_global_batch_size or rows)
        return Backend(
            cfg.policy,
            cfg.loss_fn,
            seed=cfg.run.seed,
            threads=cfg.trainer.torch_threads,
            total_updates=cfg.grpo.max_num_steps * updates_per_step,
            seq_logprob_error_threshold=cfg.grpo.seq_logprob_error_threshold,
        )

    def _restore(self) -> None:
        path = latest_checkpoint(self.ckpt_dir) if self.cfg.checkpointing.enabled else None
        if path is None:
            return
        state, meta = load_checkpoint(path)
        self.backend.load_state_dict(state["backend"])
        self.scheduler.restore(state["scheduler"])
        self.buffer.restore_consumed(set(state["consumed_ids"]))
        self.step = int(meta["step"])
        log.info("resumed from %s at step %d (%d consumed ids)", path, self.step, len(state["consumed_ids"]))

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            kind="trainer",
            url=self.url,
            pid=os.getpid(),
            host=socket.gethostname(),
            state="failed" if self.error else "ready",
            weight_version=self.weight_version,
            started_at=self.started_at,
            stats={"step": float(self.step)},
            error=self.error,
        )

    # ---- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            self._tasks.append(asyncio.create_task(self._consume(), name="trajectory-consumer"))
            await self._refit(self.step, initial=True)
            if self.cfg.grpo.val_at_start and self.validator and self.step == 0:
                # Before any training task is issued; a hit of the stop metric ends the run here.
                if self._stop_hit(await self._validate("val-start")):
                    self.state = "finished"
                    await self.redis.set(self.keys.stop, b"finished")
                    return
            if self.step < self.cfg.grpo.max_num_steps:  # resumed from the final checkpoint: nothing to collect
                await self._issue()
                await self._lookahead_barrier()
            while self.step < self.cfg.grpo.max_num_steps and not self.early_stopped:
                await self._step()
            last = self.last_validation
            if (
                self.cfg.grpo.val_at_end
                and self.validator
                and not self.early_stopped
                and not (last and last["step"] == self.step)
            ):
                await self._validate("val-end")
            self.state = "finished"
            await self.redis.set(self.keys.stop, b"finished")
            log.info("run finished after %d steps%s", self.step, " (early stop)" if self.early_stopped else "")
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("run failed: %s", self.error)
            await self._safe(self.redis.set(self.keys.stop, b"failed"))
            raise
        finally:
            await self._finish()

    async def _step(self) -> None:
        step = self.step
        await self._wait_while_paused()
        t0 = time.perf_counter()
        self.state = "collecting"
        self._step_evicted = []
        sample = await self._wait_for_batch(step)
        t_data = time.perf_counter()
        self.state = "training"
        batch = build_step_batch(
            sample.groups,
            max_len=self.cfg.policy.max_total_sequence_length,
            leave_one_out=self.cfg.grpo.use_leave_one_out_baseline,
            normalize=self.cfg.grpo.normalize_rewards,
            mask_flagged=self.cfg.env.should_mask_flagged_samples,
            on_prefix_break=self.cfg.env.on_prefix_break,
        )
        train_metrics = await asyncio.to_thread(self.backend.train_step, batch)
        t_train = time.perf_counter()
        self.state = "refit"
        report = await self._refit(step + 1)
        self.step = step + 1
        await self.redis.set(self.keys.trainer_step, str(self.step))
        self._unacked += [e for g in sample.groups for e in g.entry_ids]
        saved = await self._checkpoint_and_ack(force=False)
        record = self._step_record(step, sample, batch, train_metrics, report, t0, t_data, t_train)
        self.last_metrics = record
        self.metrics.write(record)
        # Validations due at this step boundary run on the weights just published.
        for vid in self._validations_due():
            if self._stop_hit(await self._validate(vid)):
                self.early_stopped = True
                break
        if self.early_stopped:
            if not saved:
                await self._checkpoint_and_ack(force=True)
            return
        await self._issue()

    async def _checkpoint_and_ack(self, *, force: bool) -> bool:
        """Checkpoint if due (or forced), then ack the trajectories it made durable; True if saved."""
        saved = False
        if self.cfg.checkpointing.enabled and (force or self._checkpoint_due()):
            await asyncio.to_thread(self._checkpoint)
            saved = True
        if saved or not self.cfg.checkpointing.enabled:
            # Acked only once durable: a crash before this point re-delivers them on restart.
            await self.streams.ack(self.keys.trajectories, K.TRAINER_GROUP, self._unacked)
            self._unacked = []
        for stream in (self.keys.tasks, self.keys.trajectories):  # bounded: acknowledged entries go
            await self.streams.trim_acked(stream, retention_s=self.cfg.trainer.stream_retention_s)
        return saved

    def _step_record(self, step, sample, batch, train_metrics, report, t0, t_data, t_train) -> dict[str, Any]:
        ages = [step - g.gen_version for g in sample.groups]
        targets: dict[str, int] = {}
        for t in sample.targets:
            targets[str(t - step)] = targets.get(str(t - step), 0) + 1
        elapsed = time.time() - self.started_at
        return {
            "kind": "train",
            "step": step,
            "weight_version": step,
            **batch.stats,
            **train_metrics,
            "staleness_mean": sum(ages) / len(ages),
            "staleness_max": max(ages),
            "staleness_counts": staleness_counts(step, sample.groups),
            "sampled_target_offsets": targets,
            "evicted_groups": len(self._step_evicted) // self.cfg.grpo.num_generations_per_prompt,
            "evicted_ids": sorted(self._step_evicted),
            "evicted_total": self.buffer.evicted_total,
            "duplicates_total": self.buffer.duplicates_total,
            "buffer_depth": {str(k): v for k, v in self.buffer.depth_by_target().items()},
            "in_flight_groups": {str(k): v for k, v in self.scheduler.in_flight_by_target().items()},
            "time_wait_data_s": t_data - t0,
            "time_train_s": t_train - t_data,
            "time_refit_s": report.total_s,
            **report.phase_times(),
            "refit_generators": report.generators,  # confirmed v=step+1 (membership follows scaling)
            "refit_dropped_generators": report.dropped,
            "time_step_s": time.perf_counter() - t0,
            "trajectories_received": self.trajectories_received,
            "trajectories_per_s": self.trajectories_received / max(elapsed, 1e-6),
            "consumed_ids": sorted(t.task_id for g in sample.groups for t in g.rows.values()),
            "time": time.time(),
        }

    async def _wait_for_batch(self, step: int):
        n = self.cfg.grpo.num_prompts_per_step
        deadline = time.monotonic() + self.cfg.trainer.data_timeout_s
        while True:
            self._raise_if_fatal()
            self._group_ready.clear()
            sample = self.buffer.sample(step, n)
            if sample.evicted:
                await self.streams.ack(
                    self.keys.trajectories, K.TRAINER_GROUP, [e for g in sample.evicted for e in g.entry_ids]
                )
                for g in sample.evicted:  # never trained on: the prompt is used again
                    self.scheduler.source.give_back(g.prompt_index)
                    self._step_evicted += [t.task_id for t in g.rows.values()]
            if sample.groups:
                return sample
            if sample.evicted:
                # Still short after evictions: top the window up. (Never after a successful sample:
                # the groups just taken no longer count for this step, and re-issuing them would
                # produce a full batch that arrives too late for any step.)
                await self._issue()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"step {step}: no {n} usable groups within {self.cfg.trainer.data_timeout_s:.0f}s "
                    f"(trainer.data_timeout_s); staged {self.buffer.depth_by_target()}, "
                    f"in flight {self.scheduler.in_flight_by_target()}"
                )
            try:
                await asyncio.wait_for(self._group_ready.wait(), 1.0)
            except TimeoutError:
                pass

    async def _lookahead_barrier(self) -> None:
        """Start-up and resume wait for complete batches of targets s0 and s0+1 (when the lag
        allows s0+1), so the first steps are not served by a buffer that was filled only for s0."""
        g = self.cfg.grpo
        s0, n = self.step, g.num_prompts_per_step
        targets = [s0] + ([s0 + 1] if g.async_grpo.max_trajectory_age_steps > 0 and s0 + 1 < g.max_num_steps else [])
        deadline = time.monotonic() + self.cfg.trainer.data_timeout_s
        self.state = "collecting"
        while not all(self.buffer.count_usable(t) >= n for t in targets):
            self._raise_if_fatal()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"start-up: no complete batches for targets {targets} "
                    f"within {self.cfg.trainer.data_timeout_s:.0f}s "
                    f"(trainer.data_timeout_s); staged {self.buffer.depth_by_target()}, "
                    f"in flight {self.scheduler.in_flight_by_target()}"
                )
            self._group_ready.clear()
            try:
                await asyncio.wait_for(self._group_ready.wait(), 1.0)
            except TimeoutError:
                pass
        log.info("lookahead barrier passed: complete batches staged for targets %s", targets)

    async def _refit(self, version: int, initial: bool = False):
        self.state = "refit"
        if initial:
            log.info("initial refit: publishing v%d before any task is issued", version)
        report = await self.publisher.refit(
            version,
            self.backend.save_weights,
            wait_for_generators_s=self.cfg.trainer.startup_timeout_s if initial else None,
        )
        self.weight_version = version
        self.last_refit = report
        return report

    async def _issue(self) -> None:
        if {"validation", "user"} & set(await self.pause.reasons()):
            return
        g = self.cfg.grpo
        staged = {t: self.buffer.count_usable(t) for t in self.scheduler.window(self.step, g.max_num_steps)}
        tasks = self.scheduler.plan(self.step, g.max_num_steps, staged)
        if not tasks:
            return
        try:
            await self.streams.publish_many(self.keys.tasks, tasks)
        except Exception:
            self.scheduler.unissue(tasks)
            raise
        log.info(
            "issued %d tasks (%d groups) for targets %s",
            len(tasks),
            len(tasks) // g.num_generations_per_prompt,
            sorted({t.target_step for t in tasks}),
        )

    # ---- trajectories in ----------------------------------------------------------------------

    async def _consume(self) -> None:
        try:
            backlog = await self.streams.read_group(
                self.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=10_000, pending=True
            )
            if backlog:
                log.info("re-reading %d unacknowledged trajectories from before the restart", len(backlog))
            for d in backlog:
                await self._accept(d.entry_id, d.msg)
            while not self._stopping:
                for d in await self.streams.read_group(
                    self.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=256, block_ms=1000
                ):
                    await self._accept(d.entry_id, d.msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("trajectory consumer died")
            self._fatal = exc
            self._group_ready.set()

    async def _accept(self, entry_id: str, traj: Trajectory) -> None:
        self.trajectories_received += 1
        if traj.kind == "validation":
            if self.validator is not None:
                self.validator.deliver(traj)
            await self.streams.ack(self.keys.trajectories, K.TRAINER_GROUP, [entry_id])
            return
        if traj.status == "failed" and not backfills_failures(self.cfg.env):
            tries = int(traj.metrics.get("attempts", 1))
            self._fatal = RunFailed(
                f"rollout {traj.task_id} failed after {tries} attempt(s) ({traj.fallback_reason}); "
                f"env.failure_policy is {self.cfg.env.failure_policy} (set it to backfill, or "
                "env.nemo_gym.backfill_failed_rollouts to true, to train on with a zero-token placeholder)"
            )
            self._group_ready.set()
            return
        if traj.group_id in self.cancelled_groups:
            self.cancelled_total += 1
            await self.streams.ack(self.keys.trajectories, K.TRAINER_GROUP, [entry_id])
            return
        result = self.buffer.add(traj, entry_id)
        if result is False:
            await self.streams.ack(self.keys.trajectories, K.TRAINER_GROUP, [entry_id])
        elif result is not None:
            self.scheduler.group_arrived(result.target_step, result.group_id)
            self._group_ready.set()

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise RunFailed(str(self._fatal)) from self._fatal

    # ---- pause, validation, checkpoints -------------------------------------------------------

    async def _wait_while_paused(self) -> None:
        while "user" in await self.pause.reasons():
            self.state = "paused"
            self._raise_if_fatal()
            await asyncio.sleep(0.5)

    def request_validation(self) -> str:
        """Queue a validation for the next step boundary (POST /validate); its id."""
        vid = f"val-{uuid.uuid4().hex[:8]}"
        self.validation_requests.append(vid)
        self.validations[vid] = {"validation_id": vid, "status": "queued", "requested_at_step": self.step}
        return vid

    def _validations_due(self) -> list[str]:
        """Requested validations, then the periodic one, at the boundary after ``self.step`` steps.
        Periodic: every val_period steps, once val_start_at steps are done (same cadence)."""
        due, self.validation_requests = self.validation_requests, []
        g = self.cfg.grpo
        if self.validator and periodic_due(self.step, g.val_period, g.val_start_at):
            due.append(f"val-{self.step}")
        return due

    def _stop_hit(self, result: dict[str, Any] | None) -> bool:
        g = self.cfg.grpo
        if result is None or g.stop_at_validation_metric is None:
            return False
        name = g.stop_at_validation_metric
        if name not in result:
            available = sorted(k for k, v in result.items() if isinstance(v, (int, float)))
            raise RunFailed(
                f"grpo.stop_at_validation_metric {name!r} is not a validation metric; available: {available}"
            )
        if float(result[name]) >= float(g.stop_at_validation_threshold):
            log.info(
                "validation %s: %s = %.4f reached %s; stopping",
                result["validation_id"],
                name,
                result[name],
                g.stop_at_validation_threshold,
            )
            return True
        return False

    async def _validate(self, validation_id: str) -> dict[str, Any] | None:
        entry = self.validations.setdefault(
            validation_id, {"validation_id": validation_id, "requested_at_step": self.step}
        )
        if self.validator is None:
            log.error("validation %s requested but data.val_path is not set", validation_id)
            entry.update(status="failed", error="data.val_path is not set")
            return None
        self.state = "validating"
        entry["status"] = "running"
        epoch = await self.pause.pause(PauseReason.VALIDATION)
        try:
            await self._drain()
            result = await self.validator.run(self.step, validation_id)
        except Exception as exc:
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            await self.pause.resume(PauseReason.VALIDATION, epoch)
        entry.update(status="done", result=result)
        self.last_validation = result
        self.metrics.write({**result, "time": time.time()})
        log.info(
            "validation %s at step %d: accuracy %.3f over %d",
            validation_id,
            self.step,
            result["accuracy"],
            result["num_samples"],
        )
        return result

    async def _drain(self) -> None:
        """Wait for in-flight training rollouts up to trainer.validation_drain_timeout_s; then
        proceed with them running, or cancel them (trainer.on_drain_timeout)."""
        t = self.cfg.trainer
        timeout_s = (
            t.validation_drain_timeout_s
            if t.validation_drain_timeout_s is not None
            else self.cfg.gym_gateway.rollout_timeout_s
        )
        deadline = time.monotonic() + timeout_s
        while self.scheduler.in_flight_count() and time.monotonic() < deadline:
            self._raise_if_fatal()
            await asyncio.sleep(0.2)
        left = self.scheduler.in_flight_count()
        if not left:
            return
        if t.on_drain_timeout == "proceed":
            log.warning(
                "drain before validation timed out after %.0fs with %d groups in flight; validating while they "
                "run (trainer.on_drain_timeout: proceed)",
                timeout_s,
                left,
            )
            return
        cancelled = self.scheduler.cancel_in_flight()
        self.cancelled_groups.update(cancelled)
        dropped = self.buffer.drop_pending(cancelled)
        if dropped:
            await self.streams.ack(self.keys.trajectories, K.TRAINER_GROUP, dropped)
        log.warning(
            "drain before validation timed out after %.0fs: cancelled %d in-flight groups (their prompts go "
            "back; their results will be dropped)",
            timeout_s,
            len(cancelled),
        )

    def _checkpoint_due(self) -> bool:
        c = self.cfg.checkpointing
        return c.enabled and (self.step % c.save_period == 0 or self.step >= self.cfg.grpo.max_num_steps)

    def _checkpoint(self) -> None:
        state = {
            "backend": self.backend.state_dict(),
            "scheduler": self.scheduler.state(),
            "consumed_ids": sorted(self.buffer.consumed_ids()),
        }
        save_checkpoint(
            self.ckpt_dir, self.step, state, {"weight_version": self.weight_version}, self.cfg.checkpointing.keep_last
        )

    # ---- status and shutdown ------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        gens = await live_workers(self.redis, self.keys)
        return {
            "run_id": self.cfg.run.run_id,
            "state": self.state,
            "error": self.error,
            "step": self.step,
            "max_num_steps": self.cfg.grpo.max_num_steps,
            "weight_version": self.weight_version,
            "buffer_depth": {str(k): v for k, v in self.buffer.depth_by_target().items()},
            "pending_groups": self.buffer.pending_groups(),
            "in_flight_groups": {str(k): v for k, v in self.scheduler.in_flight_by_target().items()},
            "evicted_total": self.buffer.evicted_total,
            "cancelled_rollouts_total": self.cancelled_total,
            "early_stopped": self.early_stopped,
            "pause": await self.pause.reasons(),
            "last": {k: v for k, v in self.last_metrics.items() if k not in ("consumed_ids", "evicted_ids")},
            "last_validation": self.last_validation,
            "workers": [
                {
                    "id": w.worker_id,
                    "kind": w.kind,
                    "state": w.state,
                    "weight_version": w.weight_version,
                    "in_flight": w.in_flight,
                }
                for w in gens
            ],
            "uptime_s": time.time() - self.started_at,
        }

    async def _finish(self) -> None:
        # The flag ends the consumer loop within one blocking read even if a cancel is lost
        # (redis-py can swallow one that lands while a connection returns to its pool).
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            if stuck:
                log.warning("%d background task(s) did not stop", len(stuck))
        if self._unacked and self.error is None:
            await self._safe(self.streams.ack(self.keys.trajectories, K.TRAINER_GROUP, self._unacked))
        self.metrics.close()
        if self.cfg.logger.plot:
            await asyncio.to_thread(
                plot_reward_curve,
                read_metrics(self.log_dir / "metrics.jsonl"),
                self.log_dir / "reward_curve.png",
                f"run {self.cfg.run.run_id}",
            )

    async def aclose(self) -> None:
        await self.heartbeat.aclose(self.worker_id)
        await self.redis.aclose()

    @staticmethod
    async def _safe(coro) -> None:
        try:
            await coro
        except Exception as exc:
            log.warning("ignored during shutdown: %s", exc)

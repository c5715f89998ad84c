"""The validation controller: when validations run, and what the trainer does around each one.

    POST /validate --> queued --at the next step boundary--> running --> done | failed
    periodic: at the boundary after every ``grpo.val_period`` steps, once ``grpo.val_start_at`` are done
    ``grpo.val_at_start``: before the first training task; ``grpo.val_at_end``: after the last step
    queued when the run reaches its end: they run on the final weights before it finishes
    queued when the run fails or is stopped: dropped, and GET /validations/<id> says why

Around each validation the controller pauses training-task issue (`PauseReason.VALIDATION`),
drains in-flight training rollouts up to ``trainer.validation_drain_timeout_s`` (then, by
``trainer.on_drain_timeout``, proceeds with them still running, or cancels them: their prompts go
back to the scheduler and their results are dropped on arrival), runs it on the weights just
published, resumes, and writes its record. A result may stop the run early
(``grpo.stop_at_validation_metric`` reaching ``stop_at_validation_threshold``).

Owned by the control plane; the REST routes call `request` and read `statuses`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from services.trainer.buffer import ReplayBuffer
from services.trainer.intake import RunFailed, TrajectoryIntake
from services.trainer.scheduler import Scheduler
from services.trainer.validation import ValidationRunner, periodic_due
from shared.pause import PauseControl, PauseReason
from shared.records import ValidationAccepted, ValidationRecord, ValidationState, ValidationStatus
from shared.run_config import RunConfig

log = logging.getLogger(__name__)


class ValidationRefused(Exception):
    """A validation request that cannot be queued; ``param`` names what to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ValidationController:
    def __init__(
        self,
        cfg: RunConfig,
        runner: ValidationRunner | None,
        *,
        pause: PauseControl,
        scheduler: Scheduler,
        buffer: ReplayBuffer,
        intake: TrajectoryIntake,
        write_record: Callable[[ValidationRecord], None],
    ) -> None:
        self.cfg = cfg
        self.runner = runner
        self.pause = pause
        self.scheduler = scheduler
        self.buffer = buffer
        self.intake = intake
        self.write_record = write_record
        self.statuses: dict[str, ValidationStatus] = {}  # every validation of this run, by id
        self.last: ValidationRecord | None = None
        self._requested: list[str] = []
        self._closed: str | None = None  # why requests are no longer taken

    # ---- requests -------------------------------------------------------------------------------

    def request(self, step: int) -> ValidationAccepted:
        """Queue a validation for the next step boundary (POST /validate)."""
        if self.runner is None:
            raise ValidationRefused("no validation data: set data.val_path", param="data.val_path")
        if self._closed is not None:
            raise ValidationRefused(f"no more validations: {self._closed}", param="state")
        vid = f"val-{uuid.uuid4().hex[:8]}"
        self._requested.append(vid)
        self.statuses[vid] = ValidationStatus(validation_id=vid, status="queued", requested_at_step=step)
        return ValidationAccepted(validation_id=vid, at_step=step, status="queued", result_url=f"/validations/{vid}")

    def due(self, steps_done: int) -> list[str]:
        """What runs at the boundary after ``steps_done`` steps: requests first, then the periodic one."""
        due, self._requested = self._requested, []
        g = self.cfg.grpo
        if self.runner is not None and periodic_due(steps_done, g.val_period, g.val_start_at):
            due.append(f"val-{steps_done}")
        return due

    def take_requested(self) -> list[str]:
        due, self._requested = self._requested, []
        return due

    def close(self, reason: str) -> None:
        """Take no more requests; those still queued are dropped with ``reason``."""
        self._closed = reason
        for vid in self.take_requested():
            status = self.statuses[vid]
            self.statuses[vid] = ValidationStatus(
                validation_id=vid, status="dropped", requested_at_step=status.requested_at_step, error=reason
            )
            log.warning("validation %s dropped: %s", vid, reason)

    # ---- running ------------------------------------------------------------------------------

    async def run(self, validation_id: str, step: int) -> ValidationRecord | None:
        """Pause training-task issue, drain, validate on the current weights, resume; the record
        (None when the run has no validation data)."""
        requested_at = self.statuses[validation_id].requested_at_step if validation_id in self.statuses else step
        if self.runner is None:
            log.error("validation %s requested but data.val_path is not set", validation_id)
            self._set(validation_id, "failed", requested_at, error="data.val_path is not set")
            return None
        self._set(validation_id, "running", requested_at)
        epoch = await self.pause.pause(PauseReason.VALIDATION)
        try:
            await self._drain()
            record = await self.runner.run(step, validation_id)
        except Exception as exc:
            self._set(validation_id, "failed", requested_at, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            await self.pause.resume(PauseReason.VALIDATION, epoch)
        self._set(validation_id, "done", requested_at, result=record)
        self.last = record
        self.write_record(record)
        log.info(
            "validation %s at step %d: accuracy %.3f over %d (%d failed, %d missing)",
            validation_id,
            step,
            record.accuracy,
            record.num_samples,
            record.num_failed,
            record.num_missing,
        )
        return record

    def _set(
        self,
        vid: str,
        status: ValidationState,
        requested_at: int,
        *,
        result: ValidationRecord | None = None,
        error: str | None = None,
    ) -> None:
        self.statuses[vid] = ValidationStatus(
            validation_id=vid, status=status, requested_at_step=requested_at, result=result, error=error
        )

    def stop_hit(self, record: ValidationRecord | None) -> bool:
        """Whether ``record`` reaches ``grpo.stop_at_validation_metric``'s threshold."""
        g = self.cfg.grpo
        if record is None or g.stop_at_validation_metric is None:
            return False
        name = g.stop_at_validation_metric
        value = record.metric(name)
        if value is None:
            raise RunFailed(
                f"grpo.stop_at_validation_metric {name!r} is not a validation metric; "
                f"available: {record.metric_names()}"
            )
        if value >= float(g.stop_at_validation_threshold or 0.0):
            log.info(
                "validation %s: %s = %.4f reached %s; stopping",
                record.validation_id,
                name,
                value,
                g.stop_at_validation_threshold,
            )
            return True
        return False

    async def _drain(self) -> None:
        """Wait for in-flight training rollouts up to trainer.validation_drain_timeout_s; then
        proceed with them running, or cancel them (trainer.on_drain_timeout)."""
        t = self.cfg.trainer
        timeout_s = t.validation_drain_timeout_s
        if timeout_s is None:
            timeout_s = self.cfg.gym_gateway.rollout_timeout_s
        deadline = time.monotonic() + timeout_s
        while self.scheduler.in_flight_count() and time.monotonic() < deadline:
            await self.intake.wait(min(1.0, max(0.0, deadline - time.monotonic())))
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
        self.intake.cancel_groups(cancelled)
        dropped = self.buffer.drop_pending(cancelled)
        if dropped:
            await self.intake.drop(dropped)
        log.warning(
            "drain before validation timed out after %.0fs: cancelled %d in-flight groups (their prompts go "
            "back; their results will be dropped)",
            timeout_s,
            len(cancelled),
        )

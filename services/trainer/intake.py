"""The trainer's intake: the trajectories stream into the replay buffer, in the background.

    start: re-read this consumer's unacknowledged entries (a restart) -> then new ones, 256 at a time
    each trajectory:
        validation                          -> the running validation (`deliver`), acked
        failed, and the failure policy is fail-fast  -> the intake fails (the run fails with the reason)
        of a group cancelled by a validation drain   -> dropped, counted; acked once a checkpoint
                                                        covers the cancel (saved with it)
        a duplicate (already staged or trained)      -> acked at once
        otherwise                                    -> staged in the buffer; a completed group
                                                        is reported to the scheduler and wakes the loop

Entries the buffer keeps are acked by the control plane once a checkpoint covers the step that
trained or evicted them (a restart delivers them again, to be judged against the resumed step).
The control plane's waits go through `wait`, which raises once the intake failed: a decode storm,
Redis gone or a fail-fast rollout failure ends the run loudly instead of leaving it waiting for
data that will never come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.trainer import tracing_spans
from services.trainer.buffer import ReplayBuffer
from services.trainer.scheduler import Scheduler
from shared import keys as K
from shared.protocol import Trajectory
from shared.sections.gateway import EnvSection, backfills_failures
from shared.streams import StreamClient
from shared.tasks import cancel_and_wait
from shared.wakeup import Wakeup

log = logging.getLogger(__name__)

BACKLOG_BATCH = 10_000
READ_BATCH = 256
READ_BLOCK_MS = 1000


class RunFailed(RuntimeError):
    """The run cannot continue; the message says why."""


class TrajectoryIntake:
    def __init__(
        self,
        streams: StreamClient,
        buffer: ReplayBuffer,
        scheduler: Scheduler,
        env_cfg: EnvSection,
        *,
        deliver_validation: Callable[[Trajectory], None],
        hold_acks: Callable[[list[str]], None] | None = None,
        observe: Callable[[Trajectory], None] | None = None,
    ) -> None:
        self.streams = streams
        self.buffer = buffer
        self.scheduler = scheduler
        self.env_cfg = env_cfg
        self.deliver_validation = deliver_validation
        self.observe = observe  # a hook called with every trajectory read (benchmarks)
        self.received_total = 0
        self.cancelled_groups: set[str] = set()  # saved with every checkpoint
        self.cancelled_total = 0  # rollouts of cancelled groups dropped on arrival
        # Acknowledges entries once a checkpoint covers the step that dropped them (the
        # checkpointer's hold): until then a restart must see them again, as the scheduler state
        # it restores still waits for their groups.
        self.hold_acks = hold_acks
        self.error: BaseException | None = None
        self._wakeup = Wakeup()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._consume(), name="trajectory-intake")

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        if self._task is not None and await cancel_and_wait([self._task], timeout_s=timeout_s, grace_s=0.0):
            log.warning("the trajectory intake did not stop within %.0fs", timeout_s)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RunFailed(str(self.error)) from self.error

    async def wait(self, timeout_s: float) -> None:
        """Return when a group completed or ``timeout_s`` passed; raise if the intake failed."""
        self.raise_if_failed()
        await self._wakeup.wait(timeout_s)
        self.raise_if_failed()

    def cancel_groups(self, group_ids: set[str]) -> None:
        """Rollouts of these groups are dropped when they arrive (a validation drain cancelled them)."""
        self.cancelled_groups |= group_ids

    async def drop(self, entry_ids: list[str]) -> None:
        """Entries of cancelled groups: acknowledged once a checkpoint covers the cancel (at once
        without a checkpointer)."""
        if self.hold_acks is not None:
            self.hold_acks(entry_ids)
        else:
            await self.streams.ack(self.streams.keys.trajectories, K.TRAINER_GROUP, entry_ids)

    async def _consume(self) -> None:
        keys = self.streams.keys
        try:
            backlog = await self.streams.read_group(
                keys.trajectories, K.TRAINER_GROUP, Trajectory, count=BACKLOG_BATCH, pending=True
            )
            if backlog:
                log.info("re-reading %d unacknowledged trajectories from before the restart", len(backlog))
            for d in backlog:
                await self.accept(d.entry_id, d.msg)
            while not self._stopping:
                batch = await self.streams.read_group(
                    keys.trajectories, K.TRAINER_GROUP, Trajectory, count=READ_BATCH, block_ms=READ_BLOCK_MS
                )
                for d in batch:
                    await self.accept(d.entry_id, d.msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("trajectory intake died")
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._wakeup.set()

    async def accept(self, entry_id: str, traj: Trajectory) -> None:
        self.received_total += 1
        if self.observe is not None:
            self.observe(traj)
        if traj.kind == "validation":
            self.deliver_validation(traj)
            await self._ack(entry_id)
        elif traj.status == "failed" and not backfills_failures(self.env_cfg):
            self._fail(self._fail_fast_error(traj))
        elif traj.group_id in self.cancelled_groups:
            self.cancelled_total += 1
            tracing_spans.dropped(traj, "cancelled: its group was cancelled by a validation drain")
            await self.drop([entry_id])
        else:
            result = self.buffer.add(traj, entry_id)
            if result is False:
                await self._ack(entry_id)
            elif result is not None:
                self.scheduler.group_arrived(result.target_step, result.group_id)
                self._wakeup.set()

    def _fail_fast_error(self, traj: Trajectory) -> RunFailed:
        tries = int(traj.metrics.get("attempts", 1))
        return RunFailed(
            f"rollout {traj.task_id} failed after {tries} attempt(s) ({traj.fallback_reason}); "
            f"env.failure_policy is {self.env_cfg.failure_policy} (set it to backfill, or "
            "env.nemo_gym.backfill_failed_rollouts to true, to train on with a zero-token placeholder)"
        )

    async def _ack(self, entry_id: str) -> None:
        await self.streams.ack(self.streams.keys.trajectories, K.TRAINER_GROUP, [entry_id])

"""Trainer checkpoints, and the acknowledgements that wait for them.

Layout of one checkpoint, written to a temporary folder and renamed, so a crash mid-save leaves
the previous checkpoint intact; the newest complete one is restored at start-up::

    <checkpoint_dir>/step_000010/
        learner/        the learner's part: model, optimizer, schedule, RNG (its backend decides the files)
        control.json    the control plane's part: the scheduler's prompt cursor, the consumed-id ledger
        meta.json       step, weight version, time
    <checkpoint_dir>/latest_checkpoint_status.json
                    the newest complete checkpoint: step, weight version, when, its folder, and
                    whether the run's last step is in it (for a scheduler or a script to read)

`Checkpointer` saves at ``checkpointing.save_period`` steps, after the first step that ends
``checkpointing.save_period_s`` seconds after the last save (wall clock), and at the last step. It holds back the
acknowledgement of the trajectories a step trained until a checkpoint that includes the step is
on disk: a crash before it re-delivers them, and the restored ledger refuses any already trained.
With ``checkpointing.async_save`` the learner's shards are written in the background while the
next step trains; ``meta.json``, the rename and the acknowledgements follow once they are on disk,
and the next checkpoint first waits for that (the last step's checkpoint is always waited for).
After each step it also trims the tasks and trajectories streams by acknowledged id (never an
unacknowledged entry; ``trainer.stream_retention_s`` of acknowledged history stays).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import msgspec

from services.trainer.learner import Learner
from services.trainer.scheduler import SchedulerState
from shared import keys as K
from shared.sections.trainer import CheckpointSection
from shared.streams import StreamClient

log = logging.getLogger(__name__)


class ControlState(msgspec.Struct, kw_only=True):
    """The control plane's part of a checkpoint."""

    scheduler: SchedulerState
    consumed_ids: list[str]
    # groups a validation drain cancelled: their rollouts are dropped when they arrive, also after
    # a restart (their prompts went back to the scheduler, whose state is saved alongside)
    cancelled_groups: list[str] = msgspec.field(default_factory=list)


class CheckpointMeta(msgspec.Struct, kw_only=True):
    step: int  # steps done
    weight_version: int
    saved_at: float


class CheckpointStatus(msgspec.Struct, kw_only=True):
    """``latest_checkpoint_status.json``: the newest complete checkpoint."""

    step: int  # steps done
    weight_version: int
    saved_at: float  # unix time
    path: str  # its folder
    run_finished: bool  # the run's last step is in it: nothing is left to train


STATUS_FILE = "latest_checkpoint_status.json"


def write_status(ckpt_dir: Path, status: CheckpointStatus) -> None:
    """Replace the status file in one rename, so a reader never sees half of it."""
    tmp = ckpt_dir / f".{STATUS_FILE}.tmp"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(status), indent=2))
    tmp.rename(ckpt_dir / STATUS_FILE)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = sorted(p for p in ckpt_dir.glob("step_[0-9]*") if (p / "meta.json").is_file())
    return done[-1] if done else None


async def save_checkpoint(
    ckpt_dir: Path, learner: Learner, control: ControlState, meta: CheckpointMeta, keep_last: int
) -> Path:
    tmp = await stage_checkpoint(ckpt_dir, learner, control, meta)
    return await complete_checkpoint(ckpt_dir, learner, tmp, meta, keep_last)


async def stage_checkpoint(ckpt_dir: Path, learner: Learner, control: ControlState, meta: CheckpointMeta) -> Path:
    """Start a checkpoint in a temporary folder: the learner's part (perhaps still being written in
    the background) and the control plane's."""
    tmp = ckpt_dir / f".step_{meta.step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "learner").mkdir(parents=True)
    await learner.save(tmp / "learner")
    (tmp / "control.json").write_bytes(msgspec.json.encode(control))
    return tmp


async def complete_checkpoint(
    ckpt_dir: Path, learner: Learner, tmp: Path, meta: CheckpointMeta, keep_last: int
) -> Path:
    """Once the learner's part is on disk: mark the folder complete, give it its name, prune."""
    await learner.wait_saved()
    final = ckpt_dir / f"step_{meta.step:06d}"
    (tmp / "meta.json").write_bytes(msgspec.json.encode(meta))  # last: it marks the folder complete
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(ckpt_dir.glob("step_[0-9]*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint saved: %s", final)
    return final


async def load_checkpoint(path: Path, learner: Learner) -> tuple[ControlState, CheckpointMeta]:
    """Restore the learner from ``path``; the control plane's state and the meta to apply."""
    await learner.load(path / "learner")
    control = msgspec.json.decode((path / "control.json").read_bytes(), type=ControlState)
    meta = msgspec.json.decode((path / "meta.json").read_bytes(), type=CheckpointMeta)
    return control, meta


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointSection,
        ckpt_dir: Path,
        streams: StreamClient,
        learner: Learner,
        *,
        max_num_steps: int,
        stream_retention_s: float,
    ) -> None:
        self.cfg = cfg
        self.ckpt_dir = ckpt_dir
        self.streams = streams
        self.learner = learner
        self.max_num_steps = max_num_steps
        self.stream_retention_s = stream_retention_s
        self.unacked: list[str] = []  # entries of trained trajectories waiting for a durable checkpoint
        self._writing: asyncio.Task[None] | None = None  # a checkpoint completing in the background
        self._last_save = time.monotonic()  # or the start: save_period_s counts from here

    def hold(self, entry_ids: list[str]) -> None:
        """Acknowledge these entries once a checkpoint covers the step that trained them."""
        self.unacked += entry_ids

    def due(self, step: int) -> bool:
        c = self.cfg
        by_time = c.save_period_s is not None and time.monotonic() - self._last_save >= c.save_period_s
        return c.enabled and (step % c.save_period == 0 or step >= self.max_num_steps or by_time)

    async def after_step(self, control: ControlState, meta: CheckpointMeta, *, force: bool = False) -> bool:
        """Checkpoint if due (or forced), then ack what it made durable and trim the streams;
        True if a checkpoint was saved."""
        saved = False
        if self.cfg.enabled and (force or self.due(meta.step)):
            await self.settle()
            held, self.unacked = self.unacked, []
            self._last_save = time.monotonic()
            tmp = await stage_checkpoint(self.ckpt_dir, self.learner, control, meta)
            self._writing = asyncio.create_task(self._complete(tmp, meta, held), name=f"checkpoint {meta.step}")
            if force or not self.cfg.async_save or meta.step >= self.max_num_steps:
                await self.settle()
            saved = True
        elif not self.cfg.enabled:
            await self.ack_held()
        keys = self.streams.keys
        for stream in (keys.tasks, keys.trajectories):  # bounded: acknowledged entries go
            await self.streams.trim_acked(stream, retention_s=self.stream_retention_s)
        return saved

    async def settle(self) -> None:
        """Wait for the checkpoint completing in the background, if any (raises its failure)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing

    async def _complete(self, tmp: Path, meta: CheckpointMeta, held: list[str]) -> None:
        final = await complete_checkpoint(self.ckpt_dir, self.learner, tmp, meta, self.cfg.keep_last)
        status = CheckpointStatus(
            step=meta.step,
            weight_version=meta.weight_version,
            saved_at=meta.saved_at,
            path=str(final),
            run_finished=meta.step >= self.max_num_steps,
        )
        write_status(self.ckpt_dir, status)
        await self.streams.ack(self.streams.keys.trajectories, K.TRAINER_GROUP, held)

    async def ack_held(self) -> None:
        await self.streams.ack(self.streams.keys.trajectories, K.TRAINER_GROUP, self.unacked)
        self.unacked = []

    async def restore(self) -> tuple[ControlState, CheckpointMeta] | None:
        """Load the newest checkpoint into the learner; None when there is none (or checkpointing is off)."""
        path = latest_checkpoint(self.ckpt_dir) if self.cfg.enabled else None
        if path is None:
            return None
        control, meta = await load_checkpoint(path, self.learner)
        log.info("resumed from %s at step %d (%d consumed ids)", path, meta.step, len(control.consumed_ids))
        return control, meta


def checkpoint_meta(step: int, weight_version: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, weight_version=weight_version, saved_at=time.time())

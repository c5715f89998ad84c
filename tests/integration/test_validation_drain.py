"""The drain before a validation, on the trainer's control plane running its real loop (real
Valkey, the torch learner on the tiny model) against a generator and a gateway played through
Redis. The gateway starts every task it reads (it reads only while the launch gate is open) and
finishes it when the test lets it, so training rollouts run as long as a test needs.

Each run: 3 steps, lag 1, a validation after step 1 (``grpo.val_period: 2``). Step 1 issues the
two groups of target 2; the gateway finishes row 0 of each at once and holds row 1, so both
groups are in flight (half staged) when the validation starts. What a user relies on:
* the validation waits until the running training rollouts finished: meanwhile no task of any
  kind is issued (the ``validation`` pause stops training-task issue; the launch gate stays open
  so running rollouts can finish), and no training rollout overlaps the validation;
* ``trainer.on_drain_timeout: proceed``: at the deadline the validation runs while they still
  run; they finish afterwards and step 2 trains them (nothing lost);
* ``trainer.on_drain_timeout: cancel``: at the deadline their prompts go back and step 2 trains
  them in fresh groups; their rows, staged or arriving later, are dropped and acknowledged.
In every case each training trajectory is trained at most once and none stays unacknowledged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import msgspec
import pytest

from services.trainer.checkpoint import ControlState
from services.trainer.control_plane import ControlPlane
from shared import keys as K
from shared.pause import launch_gate_closed
from shared.protocol import Task, Trajectory, decode
from shared.records import TrainerState, ValidationRecord, read_records, step_records
from tests.support.peers import Peers
from tests.support.trainer import control_plane, run_to_end, stop_plane, trainer_config

pytestmark = pytest.mark.integration

LIGHTS = ("red", "green", "yellow")


def _straggler(task: Task) -> bool:
    """Row 1 of a group of target 2: still running when the validation after step 1 starts."""
    return task.kind == "train" and task.target_step == 2 and task.index_in_group == 1


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


class Run:
    """A 3-step run (8 distinct prompts, groups of 2, lag 1, validation after step 1 on 2
    prompts) and its peers; ``trainer`` overrides the trainer section."""

    def __init__(self, tmp_path, redis_url, tiny_model_dir, prefix: str, **trainer: object) -> None:
        data = tmp_path / "prompts.jsonl"
        data.write_text(
            "".join(json.dumps({"env": "crossing", "instance": {"light": LIGHTS[i % 3]}}) + "\n" for i in range(8))
        )
        cfg = trainer_config(
            tmp_path,
            redis_url,
            tiny_model_dir,
            prefix,
            data={"train_path": str(data), "val_path": str(data), "shuffle": False},
            grpo={
                "max_num_steps": 3,
                "val_period": 2,
                "max_val_samples": 2,
                "async_grpo": {"max_trajectory_age_steps": 1},
            },
            trainer={"data_timeout_s": 120.0, "refit_timeout_s": 60.0, "startup_timeout_s": 60.0, **trainer},
            refit={"max_gen_kl_error": None},  # the peers' logprobs are made up
            logger={"plot": False, "tensorboard": False},
        )
        self.control: ControlPlane = control_plane(cfg)
        self.peers = Peers(redis_url, self.control.keys)
        self.peer_task: asyncio.Task[None] | None = None
        self.loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.peer_task = asyncio.create_task(self.peers.run())
        await self.control.open()
        self.loop = asyncio.create_task(self.control.run())

    async def finished(self) -> None:
        assert self.loop is not None
        await run_to_end(self.loop, 180, self._where)
        assert self.control.state == TrainerState.FINISHED and self.control.step == 3

    async def _where(self) -> str:
        c = self.control
        return (
            f"state {c.state}, step {c.step}, pauses {await c.pause.reasons()}, "
            f"in flight {c.scheduler.in_flight_by_target()}, staged {c.buffer.depth_by_target()}, "
            f"validations {[(v.validation_id, v.status) for v in c.validation.statuses.values()]}, "
            f"gateway running {[t.task_id for _, t, _ in self.peers.gateway.running]}"
        )

    async def stop(self) -> None:
        await stop_plane(self.control, self.peers.redis, self.loop, self.peer_task)

    async def tasks(self) -> list[tuple[str, Task]]:
        """Every task issued: (stream entry id, task)."""
        entries = await self.control.redis.xrange(self.control.keys.tasks)
        return [(e.decode(), decode(f[K.ENTRY_FIELD], Task)) for e, f in entries]

    async def trajectories(self) -> dict[str, tuple[str, Trajectory]]:
        """Every trajectory published, by task id: (stream entry id, trajectory)."""
        entries = await self.control.redis.xrange(self.control.keys.trajectories)
        return {t.task_id: (e.decode(), t) for e, t in ((e, decode(f[K.ENTRY_FIELD], Trajectory)) for e, f in entries)}

    def validation(self) -> ValidationRecord:
        records = read_records(self.control.log_dir / "metrics.jsonl")
        [record] = [r for r in records if isinstance(r, ValidationRecord)]
        assert record.validation_id == "val-2" and record.step == 2
        assert record.num_samples == 2 and record.num_missing == 0
        return record

    def trained(self) -> list[list[str]]:
        """The task ids each step trained on, in step order."""
        records = step_records(read_records(self.control.log_dir / "metrics.jsonl"))
        assert [r.step for r in records] == [0, 1, 2]
        return [list(r.consumed_ids) for r in records]

    async def with_stragglers_past_the_validation(
        self,
    ) -> tuple[ValidationRecord, list[tuple[str, Task]], dict[str, tuple[str, Trajectory]]]:
        """The run to its end, its stragglers finishing only once the validation is over (it cannot
        have waited for them): the validation's record, the tasks and the trajectories."""
        self.peers.gateway.finish = lambda task: not _straggler(task) or self.control.validation.last is not None
        await self.start()
        await self.finished()
        return self.validation(), await self.tasks(), await self.trajectories()

    async def check_exactly_once(self, expected: set[str]) -> list[list[str]]:
        """Each of ``expected`` (task ids) trained once, nothing else; nothing left unacknowledged."""
        trained = self.trained()
        flat = [tid for step in trained for tid in step]
        assert len(flat) == len(set(flat)) and set(flat) == expected
        pending = await self.control.redis.xpending(self.control.keys.trajectories, K.TRAINER_GROUP)
        assert pending["pending"] == 0
        assert await self.control.pause.reasons() == {}  # the validation's pause ended
        return trained


async def test_a_validation_waits_for_running_training_rollouts_and_none_overlaps_it(
    tiny_model_dir, redis_url, tmp_path
):
    run = Run(tmp_path, redis_url, tiny_model_dir, "drain-wait", validation_drain_timeout_s=120.0)
    control, peers = run.control, run.peers
    released = False
    peers.gateway.finish = lambda task: released or not _straggler(task)
    looks = 0  # how often the drain looked at what is in flight: during a validation only it waits on the intake
    intake_wait = control.intake.wait

    async def counted_wait(timeout_s: float) -> None:
        nonlocal looks
        looks += 1
        await intake_wait(timeout_s)

    control.intake.wait = counted_wait  # type: ignore[method-assign]
    try:
        await run.start()
        await _until(lambda: control.state == TrainerState.VALIDATING, "the validation after step 1")
        issued = await control.redis.xlen(control.keys.tasks)
        held = sorted(t.task_id for _, t in await run.tasks() if _straggler(t))
        # The drain waits for the two rows still running: the gateway holds both, and the drain
        # has looked at them three times more (at least once a second) without moving on.
        looked = looks
        await _until(
            lambda: sorted(t.task_id for _, t, _ in peers.gateway.running) == held and looks >= looked + 3,
            "the gateway holding both stragglers and three more looks of the drain",
        )
        assert control.validation.statuses["val-2"].status == "running"
        assert (await control.pause.reasons()).keys() == {"validation"}
        assert await control.pause.stops_task_issue() and not await launch_gate_closed(control.redis, control.keys)
        assert await control.redis.xlen(control.keys.tasks) == issued  # no training task, no validation task
        stragglers = sorted(t.task_id for _, t in await run.tasks() if _straggler(t))
        assert len(stragglers) == 2 and sorted(t.task_id for _, t, _ in peers.gateway.running) == stragglers
        released = True
        await run.finished()

        record = run.validation()
        tasks, trajs = await run.tasks(), await run.trajectories()
        val = [trajs[t.task_id][1] for _, t in tasks if t.kind == "validation"]
        val_start, val_end = min(t.started_at for t in val), max(t.finished_at for t in val)
        assert record.time - record.duration_s <= val_start and val_end <= record.time
        train = [t for _, t in trajs.values() if t.kind == "train"]
        for t in train:  # no training rollout overlaps the validation
            assert t.finished_at <= val_start or t.started_at >= val_end, (t.task_id, t.started_at, t.finished_at)
        # Redis' own clock agrees (entry ids are its milliseconds): the validation's tasks were
        # added no earlier than the stragglers' results.
        first_val_task = min(_stream_id(e)[0] for e, t in tasks if t.kind == "validation")
        assert max(_stream_id(trajs[tid][0])[0] for tid in stragglers) <= first_val_task
        trained = await run.check_exactly_once({t.task_id for t in train})
        assert set(stragglers) <= set(trained[2])
        assert len(train) == 12 and control.intake.cancelled_total == 0
    finally:
        await run.stop()


async def test_at_the_drain_deadline_proceed_validates_while_stragglers_run_and_trains_them_later(
    tiny_model_dir, redis_url, tmp_path
):
    run = Run(
        tmp_path, redis_url, tiny_model_dir, "drain-proceed", validation_drain_timeout_s=0.5, on_drain_timeout="proceed"
    )
    control = run.control
    try:
        record, tasks, trajs = await run.with_stragglers_past_the_validation()
        stragglers = [trajs[t.task_id][1] for _, t in tasks if _straggler(t)]
        assert len(stragglers) == 2
        for t in stragglers:  # running all through the validation
            assert t.started_at < record.time - record.duration_s and t.finished_at >= record.time
        train = {t.task_id for _, t in trajs.values() if t.kind == "train"}
        assert len(train) == 12  # no group issued again: nothing was cancelled
        trained = await run.check_exactly_once(train)
        assert {t.task_id for t in stragglers} <= set(trained[2])  # trained by the next step
        assert control.intake.cancelled_total == 0
    finally:
        await run.stop()


async def test_at_the_drain_deadline_cancel_gives_the_prompts_back_and_drops_the_stragglers(
    tiny_model_dir, redis_url, tmp_path
):
    run = Run(
        tmp_path, redis_url, tiny_model_dir, "drain-cancel", validation_drain_timeout_s=0.5, on_drain_timeout="cancel"
    )
    control = run.control
    try:
        record, tasks, trajs = await run.with_stragglers_past_the_validation()
        first_val_task = min(_stream_id(e) for e, t in tasks if t.kind == "validation")
        target2 = [t for _, t in tasks if t.kind == "train" and t.target_step == 2]
        cancelled = {t.group_id for e, t in tasks if t in target2 and _stream_id(e) < first_val_task}
        fresh = {t.group_id for t in target2} - cancelled
        assert len(cancelled) == 2 and len(fresh) == 2  # the cancelled groups' prompts, issued again
        for tid in (t.task_id for t in target2 if t.group_id in cancelled and _straggler(t)):
            assert trajs[tid][1].finished_at >= record.time  # still running when the validation ended
        prompts = {g: {t.prompt_index for t in target2 if t.group_id == g} for g in cancelled | fresh}
        assert sorted(p for g in cancelled for p in prompts[g]) == sorted(p for g in fresh for p in prompts[g])
        # Both rows of every cancelled group were published (the staged one before the deadline,
        # the straggler after the validation) and neither was trained; step 2 trained the fresh
        # groups; nothing of theirs is left unacknowledged.
        dropped = {tid for tid, (_, t) in trajs.items() if t.group_id in cancelled}
        assert len(dropped) == 4
        train = {tid for tid, (_, t) in trajs.items() if t.kind == "train"} - dropped
        trained = await run.check_exactly_once(train)
        assert {t.task_id for t in target2 if t.group_id in fresh} == set(trained[2])
        assert control.intake.cancelled_total == 2  # the stragglers, dropped on arrival
        assert control.scheduler.in_flight_count() == 0
        # The cancel is saved with the checkpoints (a restart still drops the stragglers), and their
        # entries were acknowledged by a checkpoint, not at once (check_exactly_once: none pending).
        [last] = sorted((control.checkpointer.ckpt_dir).glob("step_*"))[-1:]
        saved = msgspec.json.decode((last / "control.json").read_bytes(), type=ControlState)
        assert set(saved.cancelled_groups) == cancelled
    finally:
        await run.stop()

"""An eviction is acknowledged only once it is durable: the trainer is killed (SIGKILL) after it
evicted a stale group and before the next checkpoint; the restarted trainer gets the group's
entries again, judges them against the resumed step (evicted again, by id, in a step record), and
the ledger accounts for every trajectory ever published: trained, evicted by id, or still pending.

The stale group is an abandoned run's leftover, as after a crash: two rows of a real group made by
weight version 0 or 1, published again under a new group id once the run is past step 3, where
the staleness bound (lag 1) no longer admits them. Services run as processes (the transformers
engine on the tiny model), as in tests/faults/test_trainer_kill.py.
"""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from shared import keys as K
from shared.protocol import Trajectory, decode, encode
from tests.support.runs import FaultRun, assert_every_step_trained_once, demo_run, ledger

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STEPS, PROMPTS, GENS, SAVE_PERIOD = 7, 2, 2, 3


def stale_copy(rows: list[Trajectory], target: int) -> list[Trajectory]:
    """The group of ``rows`` under a new group id and task ids, staged for ``target``."""
    gid = f"leftover-{os.getpid()}"
    return [
        msgspec.structs.replace(t, group_id=gid, task_id=f"{gid}/{t.index_in_group}", target_step=target) for t in rows
    ]


def pending_task_ids(run: FaultRun) -> set[str]:
    with run.client() as r:
        rows = r.xpending_range(run.keys.trajectories, K.TRAINER_GROUP, "-", "+", 10_000)
        ids = [row["message_id"] for row in rows]
        out = set()
        for eid in ids:
            [(_, fields)] = r.xrange(run.keys.trajectories, eid, eid)
            out.add(decode(fields[K.ENTRY_FIELD], Trajectory).task_id)
        return out


@pytest.fixture(scope="module")
def evicted_then_killed(tmp_path_factory, tiny_model_dir, redis_url):
    tmp = tmp_path_factory.mktemp("evict-kill")
    more = {"grpo.async_grpo.max_trajectory_age_steps": 1, "checkpointing.save_period": SAVE_PERIOD}
    run = demo_run(tmp, tiny_model_dir, redis_url, f"evict-kill-{os.getpid()}", (STEPS, PROMPTS, GENS), **more)
    log = run.folder / "trainer.log"
    try:
        trainer = run.start_services()
        run.wait_for(
            "the first checkpoint", lambda: (run.out / "checkpoints" / f"step_{SAVE_PERIOD:06d}").is_dir(), 400
        )
        early = [t for t in list(run.published.entries) if t[1].kind == "train" and t[1].launch_version in (0, 1)]
        group = [t for _, t in early if t.group_id == early[0][1].group_id]
        assert len(group) == GENS, group
        leftovers = stale_copy(group, SAVE_PERIOD + 1)
        with run.client() as r:
            for t in leftovers:
                r.xadd(run.keys.trajectories, {K.ENTRY_FIELD: encode(t)})
        run.wait_for("the eviction", lambda: "evicted 1 stale groups" in log.read_text(), 300, poll_s=0.01)
        trainer.kill9()
        newest = max(int(p.name.split("_")[1]) for p in (run.out / "checkpoints").glob("step_*"))
        pending_at_kill = pending_task_ids(run)
        before = run.records()
        assert run.restart("trainer").proc.wait(500) == 0, run.logs()
        after = run.records()
        time.sleep(0.5)
        pending_at_end = pending_task_ids(run)
    finally:
        run.stop_all()
    published = {t.task_id for _, t in run.published.entries if t.kind == "train"}
    return {
        "leftovers": {t.task_id for t in leftovers},
        "newest_checkpoint": newest,
        "pending_at_kill": pending_at_kill,
        "pending_at_end": pending_at_end,
        "before": before,
        "after": after,
        "published": published,
    }


def test_the_evicted_entries_stay_pending_until_a_checkpoint_covers_the_eviction(evicted_then_killed):
    e = evicted_then_killed
    assert e["newest_checkpoint"] == SAVE_PERIOD  # killed between the eviction and the next checkpoint
    assert e["leftovers"] <= e["pending_at_kill"]


def test_after_the_resume_they_are_evicted_again_by_id_and_acknowledged(evicted_then_killed):
    e = evicted_then_killed
    resumed = e["after"][len(e["before"]) :]
    evicted_after = {i for r in resumed if r.get("kind") == "train" for i in r.get("evicted_ids", [])}
    assert e["leftovers"] <= evicted_after
    assert not e["leftovers"] & e["pending_at_end"]
    assert_every_step_trained_once(e["after"], STEPS, PROMPTS * GENS)


def test_every_published_trajectory_is_trained_evicted_by_id_or_pending(evicted_then_killed):
    e = evicted_then_killed
    trained = {i for ids in ledger(e["after"]).values() for i in ids}
    evicted = {i for r in e["after"] if r.get("kind") == "train" for i in r.get("evicted_ids", [])}
    unaccounted = e["published"] - trained - evicted - e["pending_at_end"]
    assert not unaccounted, sorted(unaccounted)

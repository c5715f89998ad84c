"""Replay buffer: group assembly, staging by target, eviction, future-target consumption, ledger."""

import pytest

from services.trainer.buffer import ReplayBuffer
from shared.protocol import Trajectory, make_turn
from tests.support.messages import make_trajectory

pytestmark = pytest.mark.unit

G = 2


def traj(group: str, idx: int, target: int, version: int, reward: float = 1.0) -> Trajectory:
    turn = make_turn(
        prompt_ids=[1, 2], context_len=0, generated_ids=[3], generated_logprobs=[-0.1], weight_version=version
    )
    return make_trajectory(
        f"{group}/{idx}", [turn], group_size=G, target_step=target, launch_version=version, reward=reward
    )


def add_group(buf: ReplayBuffer, group: str, target: int, version: int):
    assert buf.add(traj(group, 0, target, version), f"{group}-0") is None
    return buf.add(traj(group, 1, target, version), f"{group}-1")


def test_group_is_staged_only_when_all_rows_arrived():
    buf = ReplayBuffer(max_age=1)
    assert buf.add(traj("a", 1, 0, 0), "e1") is None
    assert buf.depth_by_target() == {} and buf.pending_groups() == 1
    done = buf.add(traj("a", 0, 0, 0), "e0")
    assert done.group_id == "a" and done.complete
    assert [t.index_in_group for t in done.ordered()] == [0, 1]
    assert buf.depth_by_target() == {0: 1} and buf.pending_groups() == 0


def test_target_weight_matching_prefers_current_target():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "future", target=2, version=1)  # inserted first
    add_group(buf, "now", target=1, version=1)
    res = buf.sample(step=1, n=1)
    assert [g.group_id for g in res.groups] == ["now"]


def test_future_target_groups_are_consumed_instead_of_stalling():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "g", target=3, version=1)
    res = buf.sample(step=2, n=1)
    assert [g.group_id for g in res.groups] == ["g"]


def test_future_targets_can_be_disallowed():
    buf = ReplayBuffer(max_age=1, allow_future=False)
    add_group(buf, "g", target=3, version=1)
    assert buf.sample(step=2, n=1).groups == []


def test_future_targets_taken_in_ascending_order():
    buf = ReplayBuffer(max_age=2)
    add_group(buf, "t4", target=4, version=2)
    add_group(buf, "t3", target=3, version=2)
    res = buf.sample(step=2, n=1)
    assert [g.group_id for g in res.groups] == ["t3"]


def test_stale_groups_are_evicted_and_counted():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "old", target=1, version=0)
    add_group(buf, "fresh", target=2, version=1)
    res = buf.sample(step=2, n=1)
    assert [g.group_id for g in res.groups] == ["fresh"]
    assert [g.group_id for g in res.evicted] == ["old"]
    assert buf.evicted_total == 1


def test_group_generated_by_newer_weights_than_step_is_evicted():
    # Only after a resume from an earlier checkpoint: version 2 belonged to the abandoned run.
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "g", target=1, version=2)
    res = buf.sample(step=1, n=1)
    assert res.groups == [] and [g.group_id for g in res.evicted] == ["g"] and buf.evicted_total == 1


def test_insufficient_groups_returns_nothing_and_keeps_them():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "a", target=0, version=0)
    assert buf.sample(step=0, n=2).groups == []
    add_group(buf, "b", target=1, version=0)
    assert sorted(g.group_id for g in buf.sample(step=0, n=2).groups) == ["a", "b"]


def test_late_groups_of_earlier_targets_are_used_while_fresh():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "late", target=1, version=1)
    res = buf.sample(step=2, n=1)
    assert [g.group_id for g in res.groups] == ["late"]


def test_consumed_ids_are_never_handed_out_twice():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "a", target=0, version=0)
    assert len(buf.sample(step=0, n=1).groups) == 1
    # a reclaimed task republishes the same rollout
    assert buf.add(traj("a", 0, 0, 0), "dup") is False
    assert buf.duplicates_total == 1
    assert buf.pending_groups() == 0


def test_duplicate_row_within_pending_group_is_rejected():
    buf = ReplayBuffer(max_age=1)
    buf.add(traj("a", 0, 0, 0), "e0")
    assert buf.add(traj("a", 0, 0, 0), "e0b") is False


def test_count_usable_ignores_groups_too_old_for_their_target():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "ok", target=2, version=1)
    add_group(buf, "stale", target=3, version=1)
    assert buf.count_usable(2) == 1 and buf.count_usable(3) == 0


def test_rows_without_model_turns_do_not_age_their_group():
    # A rollout that failed before any model call carries version -1; under backfill its group
    # must still be trainable, not evicted as stale.
    buf = ReplayBuffer(max_age=1)
    failed = make_trajectory(
        "g/0",
        [],
        group_size=G,
        target_step=3,
        launch_version=-1,
        reward=0.0,
        status="failed",
        fallback_reason="transport: refused",
    )
    assert buf.add(failed, "e-0") is None
    assert buf.add(traj("g", 1, target=3, version=2), "e-1") is not None
    res = buf.sample(step=3, n=1)
    assert [g.group_id for g in res.groups] == ["g"] and res.evicted == []
    assert res.groups[0].gen_version == 2

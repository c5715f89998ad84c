"""Scheduler (staleness window, gap fill, no silently dropped prompts) and batch building
(token-exact rows, prefix breaks masked, placeholders)."""

import json

import numpy as np
import pytest

from services.trainer.batch import build_row, build_step_batch
from services.trainer.buffer import Group
from services.trainer.scheduler import PromptSource, Scheduler
from shared.protocol import SamplingParams, Trajectory, make_turn
from tests.support.messages import make_task, make_trajectory

pytestmark = pytest.mark.unit


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"env": "echo", "instance": {"i": i}}) + "\n" for i in range(5)))
    return PromptSource(p, seed=0, shuffle=True)


def _sched(source, max_age=1):
    return Scheduler(
        source,
        num_prompts_per_step=2,
        group_size=3,
        max_age=max_age,
        default_env="crossing",
        sampling=SamplingParams(),
        rollout_timeout_s=10,
    )


def test_tasks_are_issued_only_within_the_staleness_window(source):
    s = _sched(source, max_age=1)
    tasks = s.plan(step=0, max_steps=10, staged_usable={})
    assert sorted({t.target_step for t in tasks}) == [0, 1]
    assert len(tasks) == 2 * 2 * 3  # 2 targets x 2 groups x G=3
    assert s.plan(step=0, max_steps=10, staged_usable={}) == []  # all in flight already
    sync = _sched(source, max_age=0)
    assert {t.target_step for t in sync.plan(step=4, max_steps=10, staged_usable={})} == {4}
    assert _sched(source).plan(step=9, max_steps=10, staged_usable={}) and all(
        t.target_step == 9 for t in _sched(source).plan(step=9, max_steps=10, staged_usable={})
    )


def test_only_missing_groups_are_issued_and_groups_share_explicit_ids(source):
    s = _sched(source)
    tasks = s.plan(step=0, max_steps=10, staged_usable={0: 1, 1: 2})
    assert {t.target_step for t in tasks} == {0} and len(tasks) == 3
    assert len({t.group_id for t in tasks}) == 1 and [t.index_in_group for t in tasks] == [0, 1, 2]
    assert all(t.task_id == f"{t.group_id}/{t.index_in_group}" for t in tasks)


def test_unissued_prompts_come_back_first_and_none_is_skipped(source):
    s = _sched(source)
    tasks = s.plan(step=0, max_steps=10, staged_usable={1: 2})
    given = {t.prompt_index for t in tasks}
    assert len(given) == 2
    s.unissue(tasks)
    assert s.in_flight_count() == 0
    again = {source.take()[0], source.take()[0]}
    assert again == given
    rest = {source.take()[0] for _ in range(3)}
    assert given | rest == {0, 1, 2, 3, 4}  # the epoch still covers every prompt once


def test_epoch_order_is_a_permutation(source):
    order = [source.take()[0] for _ in range(10)]
    assert sorted(order[:5]) == [0, 1, 2, 3, 4] and sorted(order[5:]) == [0, 1, 2, 3, 4]


def _traj(task_id, turns, reward=1.0, status="ok", group="g"):
    return make_trajectory(task_id, turns, group_id=group, index=int(task_id[-1]), reward=reward, status=status)


def test_row_concatenates_turns_and_masks_only_generated_tokens():
    t1 = make_turn(
        prompt_ids=[1, 2, 3], context_len=0, generated_ids=[4, 5], generated_logprobs=[-0.1, -0.2], weight_version=0
    )
    t2 = make_turn(prompt_ids=[6, 7], context_len=5, generated_ids=[8], generated_logprobs=[-0.3], weight_version=0)
    row = build_row(_traj("g/0", [t1, t2]), max_len=100)
    assert row.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.token_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    np.testing.assert_allclose(row.gen_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3], rtol=1e-6)
    assert row.sample_mask == 1.0 and not row.prefix_break


def test_prefix_break_row_is_masked_but_kept_in_the_group():
    t1 = make_turn(prompt_ids=[1, 2, 3], context_len=0, generated_ids=[4], generated_logprobs=[-0.1], weight_version=0)
    t2 = make_turn(prompt_ids=[9], context_len=2, generated_ids=[8], generated_logprobs=[-0.3], weight_version=0)
    ok = make_turn(prompt_ids=[1, 2, 3], context_len=0, generated_ids=[5], generated_logprobs=[-0.2], weight_version=0)
    g = Group("g", 0, 2, 0, rows={0: _traj("g/0", [t1, t2], reward=1.0), 1: _traj("g/1", [ok], reward=0.0)})
    batch = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False)
    broken, fine = batch.rows
    assert broken.prefix_break and broken.sample_mask == 0.0
    assert fine.advantage == pytest.approx(-1.0)  # the broken row still counts in the baseline
    assert batch.stats.num_prefix_breaks == 1 and [r.task_id for r in batch.trainable] == ["g/1"]


def test_new_sample_policy_trains_the_turns_after_a_break_as_another_row():
    t1 = make_turn(prompt_ids=[1, 2, 3], context_len=0, generated_ids=[4], generated_logprobs=[-0.1], weight_version=0)
    t2 = make_turn(
        prompt_ids=[9], context_len=2, generated_ids=[8, 7], generated_logprobs=[-0.3, -0.4], weight_version=0
    )
    t3 = make_turn(prompt_ids=[6], context_len=5, generated_ids=[5], generated_logprobs=[-0.5], weight_version=0)
    ok = make_turn(prompt_ids=[1, 2, 3], context_len=0, generated_ids=[5], generated_logprobs=[-0.2], weight_version=0)
    g = Group("g", 0, 2, 0, rows={0: _traj("g/0", [t1, t2, t3], reward=1.0), 1: _traj("g/1", [ok], reward=0.0)})
    batch = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False, on_prefix_break="new_sample")
    head, fine, tail = batch.rows
    assert head.input_ids.tolist() == [1, 2, 3, 4] and head.sample_mask == 1.0 and head.prefix_break
    # the second sample: the kept context [1, 2] is prompt, then turn 2 and turn 3 continue it
    assert tail.input_ids.tolist() == [1, 2, 9, 8, 7, 6, 5]
    assert tail.token_mask.tolist() == [0, 0, 0, 1, 1, 0, 1]
    np.testing.assert_allclose(tail.gen_logprobs, [0, 0, 0, -0.3, -0.4, 0, -0.5], rtol=1e-6)
    assert head.advantage == tail.advantage == pytest.approx(1.0) and fine.advantage == pytest.approx(-1.0)
    assert batch.stats.num_prefix_breaks == 1 and batch.stats.num_prefix_break_samples == 1
    assert [r.task_id for r in batch.trainable] == ["g/0", "g/1", "g/0"]


def test_failure_reasons_are_counted_per_step():
    ok = make_turn(prompt_ids=[1, 2], context_len=0, generated_ids=[5], generated_logprobs=[-0.2], weight_version=0)
    failed = _traj("g/0", [], reward=0.0, status="failed")
    failed.fallback_reason = "sandbox: container did not start"
    cut = _traj("g/1", [ok], reward=0.0, status="truncated")
    cut.fallback_reason = "model_refused: context full"
    batch = build_step_batch(
        [Group("g", 0, 2, 0, rows={0: failed, 1: cut})], max_len=100, leave_one_out=True, normalize=False
    )
    assert batch.stats.rollout_failures == {"sandbox": 1, "model_refused": 1}


def test_failed_rollout_is_a_placeholder_without_loss():
    ok = make_turn(prompt_ids=[1, 2], context_len=0, generated_ids=[5], generated_logprobs=[-0.2], weight_version=0)
    g = Group("g", 0, 2, 0, rows={0: _traj("g/0", [], reward=0.0, status="failed"), 1: _traj("g/1", [ok], reward=1.0)})
    batch = build_step_batch([g], max_len=100, leave_one_out=True, normalize=True)
    assert batch.rows[0].placeholder and batch.rows[0].advantage == 0.0
    assert batch.stats.num_placeholders == 1


def test_long_rows_are_truncated_to_the_configured_length():
    t = make_turn(
        prompt_ids=list(range(10)),
        context_len=0,
        generated_ids=[1] * 5,
        generated_logprobs=[-0.1] * 5,
        weight_version=0,
    )
    row = build_row(_traj("g/0", [t]), max_len=12)
    assert len(row.input_ids) == 12 and row.truncated and row.token_mask.sum() == 2


def test_env_flagged_rows_are_masked_but_count_in_the_baseline_unless_disabled():
    turn = make_turn(prompt_ids=[1, 2], context_len=0, generated_ids=[5], generated_logprobs=[-0.2], weight_version=0)
    flagged = _traj("g/0", [turn], reward=1.0)
    flagged.mask_sample = True
    g = Group("g", 0, 2, 0, rows={0: flagged, 1: _traj("g/1", [turn], reward=0.0)})
    on = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False, mask_flagged=True)
    assert on.rows[0].env_flagged and on.rows[0].sample_mask == 0.0
    assert on.rows[1].advantage == pytest.approx(-1.0)  # the flagged row's reward is its baseline
    assert on.stats.num_mask_sample_filtered == 1 and [r.task_id for r in on.trainable] == ["g/1"]
    off = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False, mask_flagged=False)
    assert not off.rows[0].env_flagged and off.stats.num_mask_sample_filtered == 0
    assert len(off.trainable) == 2


def test_mask_flag_is_left_out_of_the_record_when_not_carried():
    import msgspec

    from services.gym_gateway.envs.base import Outcome
    from services.gym_gateway.proxy import Session
    from services.gym_gateway.worker import assemble
    from shared.protocol import SamplingParams, decode, encode

    task = make_task("g", group_size=2)
    session = Session("s", "train", SamplingParams(), "", "", 0)
    carried = assemble(task, session, Outcome(reward=1.0), None, "gw", 0.0, carry_mask_flag=True)
    stripped = assemble(task, session, Outcome(reward=1.0, mask_sample=True), None, "gw", 0.0, carry_mask_flag=False)
    assert b'"mask_sample":false' in msgspec.json.encode(carried)  # a boolean on every rollout
    assert b"mask_sample" not in msgspec.json.encode(stripped)  # absent, not all-false
    assert decode(encode(stripped), Trajectory).mask_sample is msgspec.UNSET
    assert decode(encode(carried), Trajectory).mask_sample is False


def test_cancelled_in_flight_groups_give_their_prompts_back(source):
    s = _sched(source)
    tasks = s.plan(step=0, max_steps=10, staged_usable={1: 2})  # two groups for target 0
    arrived = tasks[0].group_id
    s.group_arrived(0, arrived)
    cancelled = s.cancel_in_flight()
    assert cancelled == {t.group_id for t in tasks} - {arrived} and s.in_flight_count() == 0
    back = next(t.prompt_index for t in tasks if t.group_id in cancelled)
    assert source.take()[0] == back  # the cancelled group's prompt is used again first


def test_cancelled_pending_groups_are_dropped_with_their_entries():
    from services.trainer.buffer import ReplayBuffer

    buf = ReplayBuffer(max_age=1)
    turn = make_turn(prompt_ids=[1], context_len=0, generated_ids=[2], generated_logprobs=[-0.1], weight_version=0)
    assert buf.add(_traj("g/0", [turn], group="g"), "e-1") is None
    assert buf.drop_pending({"g", "other"}) == ["e-1"] and buf.pending_groups() == 0


def test_rows_generated_wholly_by_the_trainers_weights_are_fresh():
    def turn(version: int, context_len: int = 0):
        return make_turn(
            prompt_ids=[1, 2],
            context_len=context_len,
            generated_ids=[5],
            generated_logprobs=[-0.2],
            weight_version=version,
        )

    rows = {
        0: _traj("g/0", [turn(3)], reward=1.0),  # the trainer's version: fresh
        1: _traj("g/1", [turn(2)], reward=0.0),  # an older version: drift, not fresh
        2: _traj("g/2", [turn(2), turn(3, context_len=3)], reward=0.0),  # spans a refit: not fresh
        3: _traj("g/3", [], reward=0.0, status="failed"),  # a placeholder
        4: _traj("g/4", [turn(3), turn(3, context_len=1)], reward=1.0),  # a prefix break: both samples fresh
    }
    g = Group("g", 0, 5, 0, rows=rows)
    batch = build_step_batch(
        [g], max_len=100, leave_one_out=True, normalize=False, on_prefix_break="new_sample", trainer_version=3
    )
    assert [(r.key, r.fresh) for r in batch.rows] == [
        ("g/0", True),
        ("g/1", False),
        ("g/2", False),
        ("g/3", False),
        ("g/4", True),
        ("g/4#1", True),
    ]
    unversioned = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False)
    assert not any(r.fresh for r in unversioned.rows)

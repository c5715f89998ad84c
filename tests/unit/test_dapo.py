"""DAPO's dynamic sampling and overlong handling: which groups carry no signal, what the buffer does
with them, the scheduler's over-issue, the soft overlong penalty and overlong filtering in the
batch, the step record's figures, and the config keys."""

import math

import msgspec
import pytest

from services.trainer.batch import build_step_batch
from services.trainer.buffer import Group, ReplayBuffer
from services.trainer.reward_shaping import OverlongPenalty, hit_token_budget
from services.trainer.scheduler import PromptSource, Scheduler
from services.trainer.step_record import dynamic_sampling_stats
from shared.config import decode_tree
from shared.config_error import ConfigError
from shared.protocol import SamplingParams, Trajectory, Turn, make_turn
from shared.run_config import RunConfig
from tests.support.messages import make_trajectory

pytestmark = pytest.mark.unit


def turn(n_gen: int = 1, finish: str = "stop", context_len: int = 0) -> Turn:
    return make_turn(
        prompt_ids=[1, 2],
        context_len=context_len,
        generated_ids=[3] * n_gen,
        generated_logprobs=[-0.1] * n_gen,
        weight_version=0,
        finish_reason=finish,
    )


def traj(
    group: str, idx: int, reward: float, *, size: int = 2, turns: list[Turn] | None = None, status: str = "ok"
) -> Trajectory:
    rows = [turn()] if turns is None else turns
    return make_trajectory(f"{group}/{idx}", rows, group_size=size, prompt_index=7, reward=reward, status=status)


def group_of(gid: str, rows: list[Trajectory]) -> Group:
    g = Group(gid, 0, len(rows), 7)
    for t in rows:
        g.rows[t.index_in_group] = t
    return g


def add_group(buf: ReplayBuffer, gid: str, rewards: list[float]) -> Group | None:
    out = None
    for i, r in enumerate(rewards):
        res = buf.add(traj(gid, i, r, size=len(rewards)), f"{gid}-{i}")
        assert res is not False
        out = res
    return out


# ---- which groups carry a signal -------------------------------------------------------------


def test_a_group_whose_rewards_all_tie_carries_no_signal():
    assert not group_of("g", [traj("g", 0, 1.0), traj("g", 1, 1.0)]).has_signal
    assert not group_of("g", [traj("g", 0, 0.0), traj("g", 1, 0.0)]).has_signal
    assert group_of("g", [traj("g", 0, 0.0), traj("g", 1, 1.0)]).has_signal


def test_placeholders_do_not_count_when_judging_a_tie():
    failed = traj("g", 2, 0.0, size=3, turns=[], status="failed")
    tie = group_of("g", [traj("g", 0, 1.0, size=3), traj("g", 1, 1.0, size=3), failed])
    assert not tie.has_signal  # the placeholder's 0 is no part of any baseline
    lone = group_of("h", [traj("h", 0, 1.0), traj("h", 1, 0.0, turns=[], status="failed")])
    assert not lone.has_signal  # one real row: its advantage is 0


# ---- the buffer -------------------------------------------------------------------------------


def test_with_dynamic_sampling_a_tied_group_is_filtered_not_staged():
    buf = ReplayBuffer(max_age=1, dynamic_sampling=True)
    done = add_group(buf, "tie", [1.0, 1.0])
    assert done is not None and done.group_id == "tie"  # it arrived (the scheduler counts it done)
    add_group(buf, "mixed", [0.0, 1.0])
    assert buf.depth_by_target() == {0: 1} and buf.count_usable(0) == 1
    assert buf.sample(step=0, n=2).groups == []  # the tied group cannot fill a step
    taken = buf.take_filtered()
    assert [g.group_id for g in taken] == ["tie"] and buf.filtered_total == 1
    assert buf.consumed("tie/0") and buf.consumed("tie/1")  # in the ledger: never trained
    assert buf.take_filtered() == []
    assert buf.add(traj("tie", 0, 1.0), "again") is False  # delivered again: a duplicate


def test_without_dynamic_sampling_a_tied_group_is_staged_and_trained():
    buf = ReplayBuffer(max_age=1)
    add_group(buf, "tie", [1.0, 1.0])
    add_group(buf, "mixed", [0.0, 1.0])
    assert sorted(g.group_id for g in buf.sample(step=0, n=2).groups) == ["mixed", "tie"]
    assert buf.take_filtered() == []


def test_a_restored_ledger_refuses_the_rows_of_filtered_groups():
    buf = ReplayBuffer(max_age=1, dynamic_sampling=True)
    add_group(buf, "tie", [0.0, 0.0])
    buf.take_filtered()
    resumed = ReplayBuffer(max_age=1, dynamic_sampling=True)
    resumed.restore_consumed(buf.consumed_ids())  # the checkpoint's ledger
    assert resumed.add(traj("tie", 0, 0.0), "e0") is False and resumed.add(traj("tie", 1, 0.0), "e1") is False
    assert resumed.pending_groups() == 0 and resumed.take_filtered() == []  # not counted twice


def test_a_filtered_group_not_yet_taken_is_not_in_the_ledger():
    """Its ids join the ledger only when a step takes it, so a checkpoint's ledger holds exactly the
    filtered ids that the step records up to it list."""
    buf = ReplayBuffer(max_age=1, dynamic_sampling=True)
    add_group(buf, "tie", [1.0, 1.0])
    assert not buf.consumed("tie/0")


# ---- the scheduler ----------------------------------------------------------------------------


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(f'{{"env": "echo", "instance": {{"i": {i}}}}}\n' for i in range(20)))
    return PromptSource(p, seed=0, shuffle=False)


def test_batch_multiplier_keeps_more_groups_coming_per_target(source):
    s = Scheduler(
        source,
        num_prompts_per_step=2,
        group_size=2,
        max_age=1,
        default_env="echo",
        sampling=SamplingParams(),
        rollout_timeout_s=10,
        batch_multiplier=1.5,
    )
    assert s.groups_per_target == 3
    tasks = s.plan(step=0, max_steps=10, staged_usable={})
    assert len({t.group_id for t in tasks if t.target_step == 0}) == 3
    assert len({t.group_id for t in tasks if t.target_step == 1}) == 3
    # a group of target 0 arrived and was filtered: it is neither in flight nor staged, so a new
    # prompt takes its place (the filtered prompt is not handed back)
    filtered = next(t for t in tasks if t.target_step == 0)
    s.group_arrived(0, filtered.group_id)
    refill = s.plan(step=0, max_steps=10, staged_usable={})
    assert len(refill) == 2 and refill[0].target_step == 0
    assert refill[0].prompt_index not in {t.prompt_index for t in tasks}


def test_batch_multiplier_rounds_up_without_float_noise():
    def per_target(n: int, m: float) -> int:
        return Scheduler(
            None,  # type: ignore[arg-type]
            num_prompts_per_step=n,
            group_size=2,
            max_age=0,
            default_env="e",
            sampling=SamplingParams(),
            rollout_timeout_s=1,
            batch_multiplier=m,
        ).groups_per_target

    assert per_target(10, 1.3) == 13 and per_target(4, 1.1) == 5 and per_target(16, 2) == 32


# ---- overlong handling ------------------------------------------------------------------------


def test_soft_overlong_penalty_follows_dapo():
    p = OverlongPenalty(max_response_length=20, buffer_length=4, penalty=1.0)
    assert p(10) == 0.0 and p(16) == 0.0  # up to max - buffer: nothing
    assert p(17) == pytest.approx(-0.25) and p(18) == pytest.approx(-0.5) and p(20) == pytest.approx(-1.0)
    assert p(35) == pytest.approx(-1.0)  # beyond the maximum: the full penalty
    assert OverlongPenalty(max_response_length=20, buffer_length=4, penalty=0.5)(18) == pytest.approx(-0.25)


def test_penalty_is_built_from_config_with_the_sequence_length_as_default():
    cfg = decode_tree(
        {"grpo": {"reward_shaping": {"enabled": True}}, "policy": {"max_total_sequence_length": 300}}, RunConfig
    )
    p = OverlongPenalty.from_config(cfg)
    assert p == OverlongPenalty(max_response_length=300, buffer_length=128, penalty=1.0)
    assert OverlongPenalty.from_config(decode_tree({}, RunConfig)) is None


def test_a_rollout_ran_out_of_tokens_when_its_last_call_hit_the_limit_or_it_was_cut():
    assert hit_token_budget(traj("g", 0, 0.0, turns=[turn(finish="length")]), cut=False)
    assert hit_token_budget(traj("g", 0, 0.0), cut=True)
    assert not hit_token_budget(traj("g", 0, 0.0), cut=False)
    # a call that hit the limit, then the agent went on and ended on its own
    ended = traj("g", 0, 0.0, turns=[turn(finish="length"), turn(finish="stop", context_len=3)])
    assert not hit_token_budget(ended, cut=False)
    assert not hit_token_budget(traj("g", 0, 0.0, turns=[], status="failed"), cut=False)


def _mixed_group(truncated_row: int) -> Group:
    rows = [traj("g", i, r, size=3) for i, r in enumerate([1.0, 0.0, 0.0])]
    rows[truncated_row] = msgspec.structs.replace(rows[truncated_row], turns=[turn(3, "length")])
    return group_of("g", rows)


def test_overlong_filtering_masks_the_truncated_row_but_keeps_it_in_the_baseline():
    g = _mixed_group(truncated_row=2)
    plain = build_step_batch([g], max_len=100, leave_one_out=True, normalize=True)
    filtered = build_step_batch([g], max_len=100, leave_one_out=True, normalize=True, overlong_filtering=True)
    assert [r.sample_mask for r in plain.rows] == [1.0, 1.0, 1.0]
    assert [r.sample_mask for r in filtered.rows] == [1.0, 1.0, 0.0]
    # same baselines: the masked row's reward still counts for its siblings
    assert [r.advantage for r in filtered.rows] == [r.advantage for r in plain.rows]
    assert filtered.stats is not None and filtered.stats.num_overlong_filtered == 1
    assert filtered.stats.num_masked_samples == 1 and filtered.rows[2] not in filtered.trainable
    assert plain.stats is not None and plain.stats.num_overlong_filtered == 0


def test_a_row_cut_at_the_sequence_length_is_overlong_too():
    g = group_of("g", [traj("g", 0, 1.0, turns=[turn(50)]), traj("g", 1, 0.0)])
    batch = build_step_batch([g], max_len=10, leave_one_out=True, normalize=True, overlong_filtering=True)
    assert [r.overlong for r in batch.rows] == [True, False] and batch.rows[0].sample_mask == 0.0


def test_the_overlong_penalty_shapes_the_advantages_not_the_reported_reward():
    # both solved: no signal from the environment, but the long one is penalised
    g = group_of("g", [traj("g", 0, 1.0, turns=[turn(4)]), traj("g", 1, 1.0, turns=[turn(18)])])
    penalty = OverlongPenalty(max_response_length=20, buffer_length=4, penalty=1.0)
    batch = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False, overlong_penalty=penalty)
    assert [r.reward_penalty for r in batch.rows] == [0.0, pytest.approx(-0.5)]
    assert batch.rows[0].advantage == pytest.approx(0.5) and batch.rows[1].advantage == pytest.approx(-0.5)
    assert [r.reward for r in batch.rows] == [1.0, 1.0]  # the environment's reward is kept
    stats = batch.stats
    assert stats is not None and stats.reward_mean == 1.0
    assert stats.num_overlong_penalized == 1 and stats.overlong_penalty_mean == pytest.approx(-0.25)
    unshaped = build_step_batch([g], max_len=100, leave_one_out=True, normalize=False)
    assert [r.advantage for r in unshaped.rows] == [0.0, 0.0]


# ---- the step record and the config ----------------------------------------------------------


def test_dynamic_sampling_figures_of_a_step():
    tied = [group_of(f"t{i}", [traj(f"t{i}", 0, 1.0), traj(f"t{i}", 1, 1.0)]) for i in range(3)]
    tied += [group_of(f"z{i}", [traj(f"z{i}", 0, 0.0), traj(f"z{i}", 1, 0.0)]) for i in range(2)]
    s = dynamic_sampling_stats(tied, num_prompts=4, groups_per_batch=4, filtered_total=11)
    assert s.num_filtered_groups == 5 and s.filtered_fraction == pytest.approx(5 / 9)
    assert s.num_gen_batches == math.ceil(9 / 4) == 3 and s.filtered_reward_mean == pytest.approx(0.6)
    assert s.filtered_total == 11
    none = dynamic_sampling_stats([], num_prompts=4, groups_per_batch=8, filtered_total=0)
    assert none.num_gen_batches == 1 and none.filtered_fraction == 0.0


def test_dapo_config_keys_have_nemo_rl_names_and_defaults():
    g = decode_tree({}, RunConfig).grpo
    assert (g.use_dynamic_sampling, g.batch_multiplier, g.dynamic_sampling_max_gen_batches) == (False, 1.0, 10)
    assert g.overlong_filtering is False
    rs = g.reward_shaping
    assert (rs.enabled, rs.overlong_buffer_length, rs.overlong_buffer_penalty, rs.max_response_length) == (
        False,
        128,
        1.0,
        None,
    )


@pytest.mark.parametrize(
    ("grpo", "key"),
    [
        ({"use_dynamic_sampling": True, "batch_multiplier": 0.5}, "grpo.batch_multiplier"),
        ({"batch_multiplier": 2.0}, "grpo.batch_multiplier"),
        (
            {"use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 0},
            "grpo.dynamic_sampling_max_gen_batches",
        ),
        ({"reward_shaping": {"enabled": True, "overlong_buffer_length": 5000}}, "overlong_buffer_length"),
        ({"reward_shaping": {"enabled": True, "overlong_buffer_penalty": -1.0}}, "overlong_buffer_penalty"),
    ],
)
def test_dapo_config_errors_name_the_key(grpo, key):
    cfg = decode_tree({"grpo": grpo}, RunConfig)
    with pytest.raises(ConfigError, match=key):
        cfg.check()


def test_a_dapo_config_passes_the_checks():
    tree = {
        "grpo": {
            "use_dynamic_sampling": True,
            "batch_multiplier": 2.0,
            "dynamic_sampling_max_gen_batches": 5,
            "overlong_filtering": True,
            "reward_shaping": {"enabled": True, "overlong_buffer_length": 64, "max_response_length": 512},
        }
    }
    decode_tree(tree, RunConfig).check()

"""The KL reward penalty (``loss_fn.use_kl_in_reward``): shaped advantages against hand-computed
values, one entry per rollout, and the step plan carrying what the learner needs for it."""

import numpy as np
import pytest

from services.trainer.batch import Row, StepBatch
from services.trainer.kl_reward import Rollout, merge_sums, rollouts_of, shaped_advantages
from services.trainer.step_plan import plan_step

pytestmark = pytest.mark.unit


def test_equal_rewards_become_advantages_by_their_kl():
    # Rewards (1, 1) tie: no signal. KL sums (0.5, 1.5), beta 0.1: shaped (0.95, 0.85); leave-one-out
    # baselines (0.85, 0.95), so (0.1, -0.1), divided by the group's std 0.1 / sqrt(2) (+1e-6).
    rollouts = [Rollout("a", "g", 1.0, False), Rollout("b", "g", 1.0, False)]
    adv = shaped_advantages(rollouts, {"a": 0.5, "b": 1.5}, 0.1, group_size=2, leave_one_out=True, normalize=True)
    std = 0.1 / np.sqrt(2.0)
    assert adv["a"] == pytest.approx(0.1 / (std + 1e-6), rel=1e-5)
    assert adv["b"] == pytest.approx(-0.1 / (std + 1e-6), rel=1e-5)
    raw = shaped_advantages(rollouts, {"a": 0.5, "b": 1.5}, 0.1, group_size=2, leave_one_out=False, normalize=False)
    assert raw == pytest.approx({"a": 0.05, "b": -0.05})


def test_placeholders_stay_out_and_rollouts_without_kl_keep_their_reward():
    # Group of 3 with a placeholder: the real pair (1 - 0.2 * 1, 0) = (0.8, 0): +-0.8 unnormalised.
    rollouts = [Rollout("a", "g", 1.0, False), Rollout("b", "g", 0.0, False), Rollout("p", "g", 0.0, True)]
    adv = shaped_advantages(rollouts, {"a": 1.0}, 0.2, group_size=3, leave_one_out=True, normalize=False)
    assert adv == pytest.approx({"a": 0.8, "b": -0.8, "p": 0.0})


def test_one_rollout_per_task_with_its_advantage_reward_and_its_kl_summed_over_ranks():
    head = _row("a", "g", reward=1.0)
    segment = _row("a", "g", reward=1.0)
    overlong = _row("b", "g", reward=1.0)
    overlong.reward_penalty = -0.25  # grpo.reward_shaping: the advantages were computed from 0.75
    rows = [head, overlong, segment]
    assert rollouts_of(rows) == [Rollout("a", "g", 1.0, False), Rollout("b", "g", 0.75, False)]
    assert merge_sums([{"a": 0.25, "b": 1.0}, {"a": 0.5}]) == {"a": 0.75, "b": 1.0}


def _row(task_id, group_id, reward=0.0, length=8, sample_mask=1.0, placeholder=False, tokens=True):
    tmask = np.zeros(length, np.float32)
    if tokens:
        tmask[length // 2 :] = 1.0
    ids = np.arange(length, dtype=np.int64)
    return Row(
        task_id,
        group_id,
        ids,
        tmask,
        np.zeros(length, np.float32),
        reward,
        sample_mask=sample_mask,
        placeholder=placeholder,
    )


def test_the_plan_spreads_the_masked_rows_that_count_in_baselines_and_lists_every_rollout():
    rows = [
        _row("t0", "g0", length=10),
        _row("t1", "g0", length=12),
        _row("m0", "g0", length=30, sample_mask=0.0),  # env-flagged: in the baseline, out of the loss
        _row("m1", "g1", length=20, sample_mask=0.0),
        _row("p0", "g1", sample_mask=0.0, placeholder=True),  # in no baseline
        _row("e0", "g1", tokens=False),  # no loss token: KL 0, nothing to score
    ]
    batch = StepBatch(rows)
    assert all(not s.baseline_rows and not s.rollouts for s in plan_step(batch, 2, None))
    shares = plan_step(batch, 2, None, reward_kl=True)
    assert sorted(r.task_id for s in shares for r in s.baseline_rows) == ["m0", "m1"]
    assert all(len(s.baseline_rows) == 1 for s in shares)  # balanced by tokens
    assert [r.task_id for r in shares[1].rollouts] == ["t0", "t1", "m0", "m1", "p0", "e0"]
    assert shares[0].rollouts == shares[1].rollouts

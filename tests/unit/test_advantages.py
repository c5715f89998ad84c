"""GRPO advantages per explicit group id."""

import numpy as np
import pytest

from services.trainer.advantages import batch_advantages, group_advantages

pytestmark = pytest.mark.unit


def test_leave_one_out_baseline_and_std():
    r = [1.0, 0.0, 0.0, 1.0]
    a = group_advantages(r, normalize=False)
    # others of row 0: [0, 0, 1] -> mean 1/3; others of row 1: [1, 0, 1] -> mean 2/3
    np.testing.assert_allclose(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    an = group_advantages(r, normalize=True)
    np.testing.assert_allclose(an, a / (np.std(r, ddof=1) + 1e-6), rtol=1e-5)


@pytest.mark.parametrize("rewards", [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0], [0.2, 0.5, 0.9], [1, 0, 0, 0, 0, 0, 0, 1]])
@pytest.mark.parametrize("loo", [True, False])
def test_group_advantages_sum_to_zero(rewards, loo):
    # A group with one success must not push shared tokens down on balance.
    assert abs(group_advantages(rewards, leave_one_out=loo, normalize=True).sum()) < 1e-5


def test_plain_group_mean_baseline():
    a = group_advantages([1.0, 0.0, 0.0, 1.0], leave_one_out=False, normalize=True)
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(a, np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6), rtol=1e-5)


def test_identical_rewards_give_zero_advantage():
    np.testing.assert_array_equal(group_advantages([0.5, 0.5, 0.5]), np.zeros(3))


def test_single_member_group_gets_zero():
    np.testing.assert_array_equal(group_advantages([1.0]), np.zeros(1))


def test_placeholders_do_not_pull_down_siblings():
    with_ph = group_advantages([1.0, 0.0, 0.0, 0.0], normalize=False, is_placeholder=[False, False, True, True])
    without = group_advantages([1.0, 0.0], normalize=False)
    np.testing.assert_allclose(with_ph[:2], without)
    assert with_ph[2] == 0 and with_ph[3] == 0


def test_identical_prompts_in_two_groups_stay_two_groups():
    # same prompt twice in the batch: grouping by prompt tokens would merge them
    a = batch_advantages(["g1", "g1", "g2", "g2"], [1.0, 0.0, 1.0, 1.0], group_size=2, normalize=False)
    np.testing.assert_allclose(a, [1.0, -1.0, 0.0, 0.0])


def test_group_size_is_checked_where_advantages_are_computed():
    with pytest.raises(ValueError, match="group 'g1' has 3 rows"):
        batch_advantages(["g1", "g1", "g1"], [1.0, 0.0, 1.0], group_size=2)


def test_positional_grouping_is_only_a_fallback_for_rows_without_ids():
    from services.trainer.advantages import resolve_group_ids

    assert resolve_group_ids(["", "", "", ""], 2) == ["pos:0", "pos:0", "pos:1", "pos:1"]
    assert resolve_group_ids(["a", "b", "a", "b"], 2) == ["a", "b", "a", "b"]  # explicit ids win
    adv = batch_advantages(["", "", "", ""], [1.0, 0.0, 0.0, 0.0], group_size=2, normalize=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_incomplete_or_mixed_positional_batches_are_errors():
    from services.trainer.advantages import resolve_group_ids

    with pytest.raises(ValueError, match="not whole groups"):
        resolve_group_ids(["", "", ""], 2)
    with pytest.raises(ValueError, match="carry no group id"):
        resolve_group_ids(["a", "", "a", ""], 2)

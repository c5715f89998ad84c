"""First-fit-decreasing packing and the efficiency figures."""

import pytest
import torch

from services.trainer.packing import (
    first_fit_decreasing,
    packed_inputs,
    packing_efficiency,
    padding_efficiency,
    unpack_logprobs,
)

pytestmark = pytest.mark.unit


def test_first_fit_decreasing_places_every_row_once_within_the_budget():
    lengths = [5, 9, 3, 7, 2, 8, 1]
    packs = first_fit_decreasing(lengths, 10)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 10 for p in packs)
    assert packs[0] == [1, 6]  # longest first (9), then the first row that still fits (1)
    assert len(packs) == 4  # 35 tokens in 10-token packs: the optimum


def test_a_row_over_the_budget_gets_its_own_pack():
    packs = first_fit_decreasing([12, 3, 3], 10)
    assert packs == [[0], [1, 2]]
    assert packing_efficiency([12, 3, 3], packs, 10) == pytest.approx(18 / 22)
    with pytest.raises(ValueError):
        first_fit_decreasing([1], 0)


def test_position_ids_restart_per_row_and_logprobs_unpack_per_row():
    ids, pos, starts = packed_inputs([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    assert ids.tolist() == [[5, 6, 7, 8, 9]] and pos.tolist() == [[0, 1, 2, 0, 1]] and starts == [0, 3]
    lp = torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0])  # -3.0 is token 8 "after" token 7: not a real logprob
    out = unpack_logprobs(lp, starts, [3, 2], width=4)
    assert out.tolist() == [[0.0, -1.0, -2.0, 0.0], [0.0, -4.0, 0.0, 0.0]]


def test_padding_efficiency_of_consecutive_micro_batches():
    assert padding_efficiency([10, 2, 4, 4], 2) == pytest.approx(20 / (20 + 8))
    assert padding_efficiency([], 2) == 1.0

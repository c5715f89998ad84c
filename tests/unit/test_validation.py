"""Validation metrics (accuracy, pass@k) and the periodic schedule with val_start_at."""

import msgspec
import pytest

from services.trainer.validation import periodic_due, summarize
from shared.protocol import Trajectory, make_turn
from tests.support.messages import make_trajectory

pytestmark = pytest.mark.unit


def _traj(prompt: int, j: int, reward: float) -> Trajectory:
    turn = make_turn(
        prompt_ids=[1, 2], context_len=0, generated_ids=[3, 4, 5], generated_logprobs=[-0.1] * 3, weight_version=0
    )
    task_id = f"v-{prompt}/{j}"
    return make_trajectory(
        task_id, [turn], group_size=4, prompt_index=prompt, kind="validation", reward=reward, metrics={"turns": 2.0}
    )


def test_grouped_validation_reports_pass_k():
    # 2 prompts, k = 4, one success: accuracy 1/8, pass@4 1/2, every-k 0.
    results = [_traj(p, j, 1.0 if (p, j) == (0, 2) else 0.0) for p in range(2) for j in range(4)]
    out = summarize(results, 4)
    assert out.accuracy == pytest.approx(0.125) and out.pass_k == pytest.approx(0.5)
    assert out.pass_all_k == 0.0 and out.num_samples == 8
    assert out.avg_length == 3.0 and out.env == {"turns": 2.0}
    # the names grpo.stop_at_validation_metric accepts
    assert out.metric("pass_k") == pytest.approx(0.5) and out.metric("env/turns") == 2.0
    assert out.metric("validation_id") is None and out.metric("env/nope") is None
    assert {"accuracy", "pass_k", "pass_all_k", "env/turns"} <= set(out.metric_names())


def test_pass_k_is_only_reported_for_k_above_one():
    single = summarize([_traj(0, 0, 1.0)], 1)
    assert single.pass_k is None and b"pass_k" not in msgspec.json.encode(single)
    assert summarize([], 2).accuracy == 0.0


def test_periodic_validation_starts_at_configured_step():
    # max steps 5, period 2, start at 3: validation after step 4 only (not re-phased to 3, 5).
    assert [s for s in range(1, 6) if periodic_due(s, 2, 3)] == [4]
    assert [s for s in range(1, 6) if periodic_due(s, 2, -1)] == [2, 4]
    assert not any(periodic_due(s, 0, -1) for s in range(1, 6))

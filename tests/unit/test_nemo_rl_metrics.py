"""A step's figures under NeMo-RL's names, on a step worked out by hand: two groups of two
rollouts (one of two turns, one that ran out of tokens, a failed placeholder, one the environment
cut and flagged), leave-one-out advantages, known phase times, two trainer ranks and two
generators. Then where the names go: the record's JSON, TensorBoard tags with NeMo-RL's exact
keys (next to streamrl's own), and the trainer's Prometheus gauge."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.trainer.batch import build_step_batch
from services.trainer.buffer import Group
from services.trainer.metrics_log import scalars
from services.trainer.nemo_rl_metrics import nemo_rl_metrics
from services.trainer.observe import TrainerMetrics
from services.trainer.refit import RefitReport
from shared.protocol import Trajectory, make_turn
from shared.records import BufferSummary, MeanMaxMin, Staleness, StepRecord, StepTiming, decode_record, encode_record
from tests.support.messages import make_trajectory
from tests.support.records import learner_metrics, step_record

pytestmark = pytest.mark.unit


def _traj(task_id: str, turns, *, reward: float, status: str = "ok", mask_sample: bool = False) -> Trajectory:
    index = int(task_id[-1])
    return make_trajectory(
        task_id,
        turns,
        index=index,
        target_step=3,
        launch_version=3,
        reward=reward,
        status=status,
        mask_sample=mask_sample,
    )


def _turn(prompt: list[int], context_len: int, generated: list[int], finish_reason: str = "stop"):
    return make_turn(
        prompt_ids=prompt,
        context_len=context_len,
        generated_ids=generated,
        generated_logprobs=[-0.5] * len(generated),
        weight_version=3,
        finish_reason=finish_reason,
    )


def _step():
    """The step: rows g/0 (7 tokens, 3 generated, advantage +1), g/1 (7 tokens, 4 generated, out
    of tokens, -1), h/0 (a failed placeholder) and h/1 (3 tokens, 1 generated, cut by the
    environment and flagged: masked; its group has one real row, so its advantage is 0)."""
    g = Group("g", 3, 2, 0)
    g.rows = {
        0: _traj("g/0", [_turn([1, 2, 3], 0, [4, 5]), _turn([6], 5, [7])], reward=1.0),
        1: _traj("g/1", [_turn([1, 2, 3], 0, [9, 9, 9, 9], finish_reason="length")], reward=0.0),
    }
    h = Group("h", 3, 2, 1)
    h.rows = {
        0: _traj("h/0", [], reward=0.0, status="failed"),
        1: _traj("h/1", [_turn([1, 2], 0, [3])], reward=0.5, status="truncated", mask_sample=True),
    }
    groups = [g, h]
    batch = build_step_batch(groups, max_len=100, leave_one_out=True, normalize=False)
    assert batch.stats is not None
    report = RefitReport(version=4, save_s=1.0, confirm_s=0.5, total_s=1.5, generators=["gen-0", "gen-1"])
    record = msgspec.structs.replace(
        step_record(3, refit=report),
        batch=batch.stats,
        learner=learner_metrics(train_tokens=7),
        staleness=Staleness(mean=0.75, max=1, counts={"0": 1, "1": 3}, sampled_target_offsets={"0": 2}),
        buffer=BufferSummary(
            depth={"3": 1, "4": 2}, in_flight_groups={}, evicted_groups=0, evicted_total=0, duplicates_total=0
        ),
        timing=StepTiming(wait_data_s=2.0, train_s=5.0, step_s=10.0, batch_s=1.0, checkpoint_s=0.5),
    )
    return record, batch, groups


def test_the_figures_of_a_step_worked_out_by_hand():
    record, batch, groups = _step()
    m = nemo_rl_metrics(record, batch, groups, trainer_ranks=2)
    timing, perf, train = m.timing, m.performance, m.train
    assert (timing.total_step_time, timing.exposed_generation, timing.data_processing) == (10.0, 2.0, 1.0)
    assert (timing.policy_training, timing.weight_sync, timing.checkpointing) == (4.0, 1.5, 0.5)
    assert timing.valid_tokens_per_sec_per_gpu == pytest.approx(7 / 10 / 4)  # 2 ranks + 2 generators
    # 4 samples and 17 tokens (7 + 7 + 3; the placeholder has none)
    assert perf.samples_per_sec == pytest.approx(0.4) and perf.samples_per_sec_per_gpu == pytest.approx(0.1)
    assert perf.tokens_per_sec == pytest.approx(1.7) and perf.tokens_per_sec_per_gpu == pytest.approx(0.425)
    assert perf.policy_training_tokens_per_sec_per_gpu == pytest.approx(17 / 4 / 2)
    assert perf.training_worker_group_tokens_per_sec == pytest.approx(17 / 4)
    assert perf.training_worker_group_tokens_per_sec_per_gpu == pytest.approx(17 / 4 / 2)
    assert perf.generation_tokens_per_sec == pytest.approx(17 / 6)  # generation: waited 2 s + trained 4 s
    assert perf.generation_tokens_per_sec_per_gpu == pytest.approx(17 / 6 / 2)
    assert train.reward == pytest.approx((1.0 + 0.0 + 0.0 + 0.5) / 4)
    assert (train.buffer_size, train.avg_trajectory_age, train.total_num_tokens) == (3, 0.75, 17)
    assert train.num_valid_samples == 2  # the placeholder and the flagged row are out of the loss
    # per generated token: 3 at +1, 4 at -1, 1 at 0 (the masked row counts, as in NeMo-RL)
    assert train.advantages == MeanMaxMin(mean=pytest.approx(-1 / 8), max=1.0, min=-1.0)
    # rollouts that are not placeholders: g/0 (2 turns, 3 tokens), g/1 (1, 4), h/1 (1, 1)
    assert train.turns_per_sample == MeanMaxMin(mean=pytest.approx(4 / 3), max=2.0, min=1.0)
    assert train.gen_tokens_per_sample == MeanMaxMin(mean=pytest.approx(8 / 3), max=4.0, min=1.0)
    # g/0 ended on its own; g/1 ran out of tokens; h/1, cut by the environment, is neither
    assert train.natural_termination_rate == pytest.approx(1 / 3) and train.truncation_rate == pytest.approx(1 / 3)


def test_a_step_of_failed_rollouts_and_no_time_reports_zeros():
    record, batch, groups = _step()
    failed = [Group(g.group_id, 3, 2, g.prompt_index) for g in groups]
    for g in failed:
        g.rows = {i: _traj(f"{g.group_id}/{i}", [], reward=0.0, status="failed") for i in range(2)}
    batch = build_step_batch(failed, max_len=100, leave_one_out=True, normalize=False)
    idle = msgspec.structs.replace(record, timing=StepTiming(wait_data_s=0.0, train_s=0.0, step_s=0.0))
    m = nemo_rl_metrics(idle, batch, failed, trainer_ranks=1)
    zeros = MeanMaxMin(mean=0.0, max=0.0, min=0.0)
    assert m.train.turns_per_sample == m.train.gen_tokens_per_sample == m.train.advantages == zeros
    assert m.train.num_valid_samples == m.train.total_num_tokens == 0 and m.train.truncation_rate == 0.0
    assert m.performance.tokens_per_sec == m.performance.generation_tokens_per_sec == 0.0


def test_the_names_are_nemo_rls_in_json_tensorboard_and_prometheus():
    record, batch, groups = _step()
    record.nemo_rl = nemo_rl_metrics(record, batch, groups, trainer_ranks=2)
    assert b'"nemo_rl":{"timing/train":{"total_step_time":10.0' in encode_record(record)
    assert decode_record(encode_record(record)) == record
    tags = dict(scalars(record))
    assert tags["timing/train/total_step_time"] == 10.0 and tags["timing/train/exposed_generation"] == 2.0
    assert tags["timing/train/weight_sync"] == 1.5 and tags["performance/tokens_per_sec"] == pytest.approx(1.7)
    assert tags["train/buffer_size"] == 3.0 and tags["train/avg_trajectory_age"] == 0.75
    assert tags["train/advantages/mean"] == pytest.approx(-1 / 8) and tags["train/num_valid_samples"] == 2.0
    assert tags["train/turns_per_sample/max"] == 2.0 and tags["train/gen_tokens_per_sample/min"] == 1.0
    assert tags["train/truncation_rate"] == pytest.approx(1 / 3)
    # streamrl's own names stay, the new phases among them
    assert tags["train/reward_mean"] == tags["train/reward"] and tags["train/timing/step_s"] == 10.0
    assert tags["train/timing/batch_s"] == 1.0 and tags["train/timing/checkpoint_s"] == 0.5
    assert not any(t.startswith(("train/nemo_rl", "nemo_rl")) for t in tags)
    assert {t.split("/")[0] for t in record.nemo_rl.named()} == {"timing", "performance", "train"}

    record.learner.policy_kl_error = 2e-3
    metrics = TrainerMetrics()
    metrics.observe_record(record)
    [family] = [
        f for f in text_string_to_metric_families(metrics.render().decode()) if f.name == "streamrl_trainer_nemo_rl"
    ]
    gauge = {s.labels["name"]: s.value for s in family.samples}
    assert gauge == record.nemo_rl.named() and gauge["timing/train/total_step_time"] == 10.0
    [learner] = [
        f for f in text_string_to_metric_families(metrics.render().decode()) if f.name == "streamrl_trainer_learner"
    ]
    figures = {s.labels["name"]: s.value for s in learner.samples}
    assert figures["loss"] == record.learner.loss and figures["policy_kl_error"] == record.learner.policy_kl_error
    assert "probs_ratio_max" not in figures  # not measured in this record: no sample, not a zero


def test_records_written_before_the_nemo_rl_figures_still_read():
    old = msgspec.json.decode(encode_record(step_record(1)))
    del old["timing"]  # an older record: no nemo_rl part, timing without batch_s/checkpoint_s
    old["timing"] = {"wait_data_s": 1.0, "train_s": 2.0, "step_s": 3.7}
    record = decode_record(msgspec.json.encode(old))
    assert isinstance(record, StepRecord) and record.nemo_rl is None and record.timing.batch_s == 0.0
    assert "train/timing/train_s" in dict(scalars(record))

"""A step record's picture of the pipeline (`services.trainer.step_record`): the fraction of the
step spent waiting for data, the learner's MFU over the rows it trained, the rollouts' duration and
the live workers per kind read from the registry of a real Valkey; and that it survives
metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest

from services.trainer.batch import build_step_batch
from services.trainer.buffer import ReplayBuffer
from services.trainer.metrics_log import MetricsLog
from services.trainer.refit import RefitReport
from services.trainer.scheduler import Scheduler
from services.trainer.step_record import PipelineMeter, StepClock, build_step_record, worker_counts
from shared import keys as K
from shared.config import decode_tree
from shared.protocol import Heartbeat, make_turn
from shared.records import read_records, step_records
from shared.registry import publish_heartbeat, remove_worker
from shared.run_config import RunConfig
from shared.streams import connect
from tests.support.messages import make_trajectory
from tests.support.records import learner_metrics

pytestmark = pytest.mark.integration

TINY_QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
N_QWEN3 = 917_504  # its matrix parameters per token (tests/unit/test_flops.py counts them by hand)


def _config(tmp_path, redis_url: str, peak: float | None) -> RunConfig:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"env": "crossing", "instance": {"light": "red"}}) + "\n")
    tree = {
        "run": {"run_id": f"pipe-{uuid.uuid4().hex[:8]}", "output_dir": str(tmp_path / "out")},
        "redis": {"url": redis_url},
        "data": {"train_path": str(data)},
        "policy": {"model_name": str(model), "precision": "bfloat16"},
        "trainer": {"peak_tflops_per_device": peak},
        "grpo": {"num_prompts_per_step": 1, "num_generations_per_prompt": 2},
    }
    return decode_tree(tree, RunConfig)


def _heartbeat(worker_id: str, kind: str) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, kind=kind, url="http://x", state="ready")  # type: ignore[arg-type]


async def test_live_workers_are_counted_by_kind(redis_url):
    redis, keys = connect(redis_url), K.RunKeys(f"count-{uuid.uuid4().hex[:8]}")
    try:
        assert await worker_counts(redis, keys) == {"generator": 0, "gym_gateway": 0}
        for wid, kind in (("g0", "generator"), ("g1", "generator"), ("gw0", "gym_gateway"), ("t", "trainer")):
            await publish_heartbeat(redis, keys, _heartbeat(wid, kind))
        assert await worker_counts(redis, keys) == {"generator": 2, "gym_gateway": 1}
        await remove_worker(redis, keys, "g1")
        await redis.zadd(keys.registry, {"gw0": time.time() - 1})  # its heartbeat expired: it died
        assert await worker_counts(redis, keys) == {"generator": 1, "gym_gateway": 0}
    finally:
        await redis.aclose()


def _group(target: int) -> list:
    """A group of two rollouts: prompts of 3 tokens, 5 and 9 generated tokens over one and two
    model calls; each ran 4 s, 1.5 s of it in model calls."""
    now = time.time()
    trajs = []
    for i, calls in enumerate(([5], [4, 5])):
        turns, context = [], 0
        for n in calls:
            turns.append(
                make_turn(
                    prompt_ids=[1, 2, 3],
                    context_len=context,
                    generated_ids=[7] * n,
                    generated_logprobs=[-0.5] * n,
                    weight_version=0,
                    latency_s=1.5 / len(calls),
                )
            )
            context += 3 + n
        trajs.append(
            make_trajectory(
                f"p0/{i}",
                turns,
                env="crossing",
                target_step=target,
                reward=float(i),
                started_at=now - 4.0,
                finished_at=now,
            )
        )
    return trajs


async def test_a_step_record_carries_mfu_wait_fraction_rollouts_and_workers(tmp_path, redis_url):
    cfg = _config(tmp_path, redis_url, peak=0.5)
    buffer, scheduler = ReplayBuffer.from_config(cfg), Scheduler.from_config(cfg)
    for k, t in enumerate(_group(target=0)):
        buffer.add(t, f"1-{k}")
    sample = buffer.sample(0, 1)
    batch = build_step_batch(sample.groups, max_len=64, leave_one_out=True, normalize=False)
    assert batch.stats is not None
    seq_lens = sorted(len(r.input_ids) for r in batch.trainable)
    assert seq_lens == [8, 15]  # 3 + 5, and 3 + 4 then 3 + 5: the rows the learner trains

    redis = connect(redis_url)
    keys = K.RunKeys(cfg.run.run_id)
    try:
        for wid, kind in (("g0", "generator"), ("g1", "generator"), ("g2", "generator"), ("gw0", "gym_gateway")):
            await publish_heartbeat(redis, keys, _heartbeat(wid, kind))
        meter = PipelineMeter(cfg, redis, keys, devices=2)
        learner = learner_metrics(train_time_s=0.25)
        figures = await meter.measure(batch, learner)
    finally:
        await redis.aclose()

    flops = sum(s * (6 * N_QWEN3 + 12 * 4 * 128 * s) for s in seq_lens)
    assert figures.model_tflops == pytest.approx(flops / 0.25 / 2 / 1e12)
    assert figures.mfu == pytest.approx(figures.model_tflops / 0.5)
    assert figures.workers == {"generator": 3, "gym_gateway": 1}

    t0 = time.perf_counter() - 10.0  # a step of about 10 s that waited 6 s for its data
    clock = StepClock(start=t0, data_ready=t0 + 6.0, batched=t0 + 6.5, trained=t0 + 8.0, checkpoint_s=0.5)
    report = RefitReport(version=1, save_s=0.4, confirm_s=0.5, total_s=1.0, generators=["g0"], checksum_s=0.1)
    record = build_step_record(
        0,
        sample,
        batch.stats,
        learner,
        report,
        clock,
        buffer=buffer,
        scheduler=scheduler,
        evicted_ids=[],
        group_size=2,
        received_total=2,
        started_at=time.time() - 20.0,
        pipeline=figures,
    )
    assert record.wait_fraction == pytest.approx(6.0 / record.timing.step_s)
    assert 0.55 < record.wait_fraction < 0.6
    assert record.rollout_s == pytest.approx(4.0, abs=0.01) and record.generation_s == pytest.approx(1.5)
    assert (record.mfu, record.model_tflops) == (figures.mfu, figures.model_tflops)
    assert record.workers == {"generator": 3, "gym_gateway": 1}

    log = MetricsLog(tmp_path / "metrics.jsonl", sinks=[])
    log.open()
    log.write(record)
    log.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["workers"] == {"generator": 3, "gym_gateway": 1} and line["mfu"] == pytest.approx(record.mfu)
    assert step_records(read_records(tmp_path / "metrics.jsonl")) == [record]


async def test_without_a_peak_on_cpu_mfu_stays_out_of_the_record(tmp_path, redis_url):
    cfg = _config(tmp_path, redis_url, peak=None)
    buffer = ReplayBuffer.from_config(cfg)
    for k, t in enumerate(_group(target=0)):
        buffer.add(t, f"1-{k}")
    batch = build_step_batch(buffer.sample(0, 1).groups, max_len=64, leave_one_out=True, normalize=False)
    redis = connect(redis_url)
    try:
        meter = PipelineMeter(cfg, redis, K.RunKeys(cfg.run.run_id), devices=1)
        meter.mfu = dataclasses.replace(meter.mfu, peak_tflops=None)  # as on a CPU (or a GPU of no known peak)
        figures = await meter.measure(batch, learner_metrics(train_time_s=0.25))
    finally:
        await redis.aclose()
    assert figures.model_tflops is not None and figures.mfu is None
    assert figures.workers == {"generator": 0, "gym_gateway": 0}

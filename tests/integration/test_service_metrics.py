"""Every service's GET /metrics, read with Prometheus' own parser after real work: the
generator's tokens/s after a generation, the gateway's rollout outcomes by reason after real
rollouts, the trainer's staleness histogram and refit phases from a step record the runtime
builds, and stream lengths and pending entries per consumer from Redis. Event-loop lag on all."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.trainer.step_record import StepClock, build_step_record
from shared import keys as K
from shared.protocol import SamplingParams, Task, Trajectory, make_turn
from tests.support.gateway import collect, gateway_task
from tests.support.messages import make_task, make_trajectory
from tests.support.records import batch_stats, learner_metrics
from tests.support.trainer import opened_plane, trainer_config

pytestmark = pytest.mark.integration


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


async def test_generator_metrics_after_a_generation(hf_generator):
    async with hf_generator(with_redis=False) as gen:
        r = await gen.client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0.8},
        )
        assert r.status_code == 200, r.text
        generated = len(r.json()["choices"][0]["message"]["generation_token_ids"])
        text = (await gen.client.get("/metrics")).text
    assert value(text, "streamrl_generator_generated_tokens_total") == generated > 0
    assert value(text, "streamrl_generator_tokens_per_second") > 0
    assert value(text, "streamrl_generator_in_flight") == 0
    assert value(text, "streamrl_generator_requests_total", route="chat", status="200") == 1
    assert 0 <= value(text, "streamrl_event_loop_lag_seconds") < 5


async def test_gateway_rollout_outcomes_by_reason(gateway_stack):
    async with gateway_stack() as st:
        await st.streams.publish_many(
            st.streams.keys.tasks, [gateway_task(0), gateway_task(1), gateway_task(2, env="no_such_env")]
        )
        trajs = await collect(st.streams, 3)
        assert sorted(t.status for t in trajs) == ["failed", "ok", "ok"]
        async with httpx.AsyncClient(base_url=st.url, timeout=30) as client:
            text = (await client.get("/metrics")).text
    assert value(text, "streamrl_gateway_rollouts_published_total") == 3
    assert value(text, "streamrl_gateway_rollouts_failed_total", reason="unknown_env") == 1
    assert not any(
        name == "streamrl_gateway_rollouts_failed_total" and dict(lb).get("reason") != "unknown_env"
        for name, lb in samples(text)
    )
    assert 0 <= value(text, "streamrl_event_loop_lag_seconds") < 5


# ---- trainer ---------------------------------------------------------------------------------


@pytest.fixture
async def trainer(tiny_model_dir, redis_url, tmp_path):
    cfg = trainer_config(
        tmp_path, redis_url, tiny_model_dir, "obs", grpo={"async_grpo": {"max_trajectory_age_steps": 2}}
    )
    async with opened_plane(cfg) as plane:
        yield plane


def _group(gid: str, target: int, versions: list[int]) -> list[Trajectory]:
    rows = []
    for i, v in enumerate(versions):
        turn = make_turn(
            prompt_ids=[1, 2], context_len=0, generated_ids=[3], generated_logprobs=[-0.5], weight_version=v
        )
        rows.append(
            make_trajectory(
                f"{gid}/{i}",
                [turn],
                group_size=len(versions),
                env="crossing",
                target_step=target,
                launch_version=v,
                reward=float(i),
            )
        )
    return rows


async def test_trainer_staleness_refit_phases_and_queues(trainer):
    from services.trainer.refit import RefitReport

    rt, client = trainer
    step = 3
    for n, (gid, versions) in enumerate((("a", [1, 2]), ("b", [3, 3]))):
        for k, t in enumerate(_group(gid, step, versions)):
            rt.buffer.add(t, f"{n + 1}-{k}")
    sample = rt.buffer.sample(step, 2)
    assert len(sample.groups) == 2
    report = RefitReport(version=step + 1, save_s=0.4, confirm_s=1.5, total_s=1.9, generators=["g0"], checksum_s=0.25)
    record = build_step_record(
        step,
        sample,
        batch_stats(0.5),
        learner_metrics(0.1),
        report,
        StepClock(
            start=time.perf_counter() - 3.0,
            data_ready=time.perf_counter() - 2.0,
            batched=time.perf_counter() - 1.5,
            trained=time.perf_counter(),
            checkpoint_s=0.0,
        ),
        buffer=rt.buffer,
        scheduler=rt.scheduler,
        evicted_ids=[],
        group_size=2,
        received_total=4,
        started_at=time.time() - 10.0,
    )
    assert record.staleness.counts == {"2": 1, "1": 1, "0": 2} and record.staleness.max == 2
    rt.metrics.write(record)  # the control plane's writer: JSONL, TensorBoard and the Prometheus sink

    # queues: 3 tasks, 2 delivered to one gateway consumer and not acked
    tasks = [
        make_task(f"t{i}", prompt_index=i, target_step=step, sampling=SamplingParams(max_tokens=4)) for i in range(3)
    ]
    await rt.streams.publish_many(rt.keys.tasks, tasks)
    from shared.streams import StreamClient

    await StreamClient(rt.redis, rt.keys, "gw-obs").read_group(
        rt.keys.tasks, K.GATEWAYS_GROUP, Task, count=2, block_ms=100
    )

    text = (await client.get("/metrics")).text
    hist = "streamrl_trainer_trajectory_staleness_steps"
    assert value(text, f"{hist}_count") == 4 and value(text, f"{hist}_sum") == 3.0
    assert value(text, f"{hist}_bucket", le="0.0") == 2 and value(text, f"{hist}_bucket", le="1.0") == 3
    phases = "streamrl_trainer_refit_phase_seconds"
    assert value(text, f"{phases}_sum", phase="write") == pytest.approx(0.4)
    assert value(text, f"{phases}_sum", phase="checksum") == pytest.approx(0.25)
    assert value(text, f"{phases}_sum", phase="confirm") == pytest.approx(1.25)
    assert value(text, "streamrl_trainer_step_phase_seconds_sum", phase="train") == pytest.approx(2.0, abs=0.05)
    assert value(text, "streamrl_trainer_reward_mean") == 0.5 and value(text, "streamrl_trainer_refit_seconds") == 1.9
    assert value(text, "streamrl_stream_length", stream="tasks") == 3
    assert value(text, "streamrl_stream_pending", stream="tasks", group=K.GATEWAYS_GROUP) == 2
    assert value(text, "streamrl_stream_lag", stream="tasks", group=K.GATEWAYS_GROUP) == 1
    assert value(text, "streamrl_consumer_pending", stream="tasks", group=K.GATEWAYS_GROUP, consumer="gw-obs") == 2
    assert value(text, "streamrl_stream_pending", stream="trajectories", group=K.TRAINER_GROUP) == 0
    assert value(text, "streamrl_trainer_step") == 0 and "streamrl_event_loop_lag_seconds" in text
    rt.metrics.close()
    assert list((rt.log_dir / "tensorboard").glob("events.out.tfevents.*"))

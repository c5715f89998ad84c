"""The autoscaler in a real run: the trainer's control plane (simulated training), gateway workers
as processes in the same worker pool and scale channel as under ``streamrl up``, rollouts that
sleep (`streamrl.bench.autoscale`, the benchmark's harness at a few steps). Started below its need,
the run asks the local backend for more gateway workers, they join, and the decision is a record
with its reason; and a backend the trainer cannot reach is refused naming the key."""

import asyncio
import dataclasses

import msgspec
import pytest

from services.trainer.autoscaler import Autoscaler
from shared import keys as K
from shared.config_error import ConfigError
from shared.records import AutoscaleRecord, read_records, step_records
from shared.run_config import RunConfig
from shared.sections.autoscale import AutoscaleSection
from shared.streams import connect
from streamrl.bench import autoscale

pytestmark = pytest.mark.integration


def test_a_starved_run_asks_for_gateway_workers_and_they_join(redis_url, tmp_path):
    # 10 steps of 1 s and 16 rollouts of 0.5 s (median): one gateway worker of 4 slots covers half
    # of what a step needs, and from step 5 on rollouts take twice as long.
    scenario = dataclasses.replace(autoscale.SCENARIO, steps=10, train_s=1.0, num_prompts=4, makespan_over_train=0.77)
    assert 0.45 < scenario.rollout_median_s < 0.55
    run = autoscale.run_one(tmp_path, redis_url, 1, autoscaled=True, scenario=scenario)

    assert run.decisions, f"no decision in a starved run: {run}"
    first = run.decisions[0]
    assert (first.before, first.outcome) == (1, "done") and first.after > 1
    assert "tasks waiting for a gateway slot" in first.reason or "gateway slots" in first.reason
    # The pool reached every count the autoscaler asked for (a request still in flight when the
    # run ended may have gone further).
    reached = {n for _, n in run.counts}
    asked = [d.after for d in run.decisions]
    assert set(asked) <= reached and run.end_count >= min(asked)

    records = read_records(tmp_path / "out" / "metrics.jsonl")
    steps = step_records(records)
    assert [r.step for r in steps] == list(range(10))
    consumed = [i for r in steps for i in r.consumed_ids]
    assert len(consumed) == len(set(consumed)) == 10 * scenario.num_prompts * scenario.group_size
    decisions = [r for r in records if isinstance(r, AutoscaleRecord)]
    assert [(d.before, d.after) for d in decisions] == [(d.before, d.after) for d in run.decisions]
    for d in decisions:
        assert d.role == "gym_gateway" and d.backend == "local" and d.signals["gym_gateway_count"] == d.before
    assert decisions[0].signals["wait_fraction"] > AutoscaleSection().scale_up_wait_fraction  # the mean it quotes
    # The step records saw the workers join.
    assert max(r.workers.get("gym_gateway", 0) for r in steps if r.workers) >= first.after


def test_a_backend_the_trainer_cannot_reach_is_refused_naming_the_key(redis_url, tmp_path):
    cfg = msgspec.convert(
        {"run": {"run_id": "autoscale-refused", "output_dir": str(tmp_path)}, "autoscale": {"enabled": True}},
        RunConfig,
    )

    async def start() -> None:
        redis = connect(redis_url)
        try:
            scaler = Autoscaler(cfg, redis, K.RunKeys("autoscale-refused"), write_record=print, busy=lambda: False)
            scaler.start()
        finally:
            await redis.aclose()

    with pytest.raises(ConfigError, match=r"autoscale\.backend: local cannot scale this run: no .*run\.json"):
        asyncio.run(start())

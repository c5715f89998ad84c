"""Faults injected one after another into one real run, all services as processes the test
started (two generators, two gateway workers, the trainer) over a Valkey with AOF on
(appendfsync always) that the test also started:

1. kill -9 of a gateway worker while rollouts run on it: the other worker reclaims its tasks after
   gym_gateway.reclaim_idle_s and publishes each trajectory once;
2. kill -9 of a generator with requests in flight: the sessions fail over to the other generator
   (or, failing that, the rollout is retried as an infrastructure failure); the next refits
   drop the dead generator and the run goes on;
3. Redis killed (kill -9) and started again on its AOF: every service reconnects, no stream entry
   is lost;
4. Redis frozen (SIGSTOP) for longer than the heartbeat TTL, in the middle of a refit: services
   wait and retry, nothing hangs, the refit does not drop the generators that were merely
   silent while Redis was.

The run must then finish on its own, and the per-step ledger in metrics.jsonl must show every step
trained with exactly N x G trajectories, none twice. The default run is short; the long variant
(STREAMRL_LONG_TESTS=1) keeps Redis down and frozen for longer and trains more steps.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from shared import keys as K
from shared.streams import REDIS_RECONNECT_BUDGET_S
from tests.support.injectors import (
    kill_gateway_mid_rollout,
    kill_generator_mid_request,
    pause_redis_during_refit,
    restart_redis,
)
from tests.support.redis import start_valkey
from tests.support.runs import assert_every_step_trained_once, demo_run, long_variant

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

PROMPTS, GENS, RECLAIM_IDLE_S = 2, 2, 3.0
SURVIVORS = ["generator-0", "gateway-0", "trainer"]
OVERRIDES = {
    "gym_gateway.reclaim_idle_s": RECLAIM_IDLE_S,
    "gym_gateway.max_concurrent_rollouts": 2,
    "env.failure_policy": "retry",
    "trainer.torch_threads": 1,
    "checkpointing.save_period": 100,
}


def _chaos_run(tmp, model_dir, *, steps: int, redis_down_s: float, redis_pause_s: float):
    server = start_valkey(tmp / "valkey", appendonly=True, appendfsync="always")
    run = demo_run(tmp, model_dir, server.url, f"chaos-{os.getpid()}", (steps, PROMPTS, GENS), **OVERRIDES)
    faults = {}
    try:
        for wid in ("generator-0", "generator-1"):
            run.start("services.generator", wid)
        for wid in ("gateway-0", "gateway-1"):
            run.start("services.gym_gateway", wid)
        trainer = run.start("services.trainer", "trainer")
        run.wait_for("the first step", lambda: run.trained_steps() >= 1, 400, poll_s=0.2)
        faults["gateway_kill"] = kill_gateway_mid_rollout(run, "gateway-1")
        faults["generator_kill"] = kill_generator_mid_request(run, "generator-1")
        faults["redis_restart"] = restart_redis(run, server, down_s=redis_down_s, survivors=SURVIVORS)
        faults["redis_pause"] = pause_redis_during_refit(run, server, pause_s=redis_pause_s, survivors=SURVIVORS)
        rc = trainer.proc.wait(400)
        run.services["gateway-0"].proc.wait(60)  # it leaves on the run's stop key, after its drain
        crashed = [wid for wid in SURVIVORS if run.services[wid].crashed()]
        trajectories = run.published.stop()
        with run.client() as r:
            pending_tasks = r.xpending(run.keys.tasks, K.GATEWAYS_GROUP)["pending"]
    finally:
        run.stop_all()
        server.stop()
    return run, faults, rc, crashed, trajectories, pending_tasks


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, tiny_model_dir):
    return _chaos_run(tmp_path_factory.mktemp("chaos"), tiny_model_dir, steps=8, redis_down_s=2.0, redis_pause_s=13.0)


def test_the_run_finishes_and_trains_every_step_once(chaos):
    run, faults, rc, crashed, _, pending = chaos
    assert rc == 0, run.logs()
    records = run.records()
    assert_every_step_trained_once(records, 8, PROMPTS * GENS)
    last_fault = max(f.ended_at for f in faults.values())
    assert sum(r["time"] > last_fault for r in records if r.get("kind") == "train") >= 1, "no step after the faults"
    assert crashed == [], run.logs()  # no fault took down a service it was not aimed at
    assert pending == 0  # no task left behind: every one was published, or released at the end


def test_every_task_is_published_once(chaos):
    _, _, _, _, trajectories, _ = chaos
    per_task = Counter(t.task_id for t in trajectories)
    assert {tid: n for tid, n in per_task.items() if n > 1} == {}
    assert all(t.status != "failed" for t in trajectories)


def test_a_killed_gateways_rollouts_are_reclaimed_and_published_once(chaos):
    run, faults, _, _, trajectories, _ = chaos
    fault = faults["gateway_kill"]
    held = fault.details["held_task_ids"]
    assert held, "the gateway was killed with no task in hand"
    by_task = {}
    for t in trajectories:
        by_task.setdefault(t.task_id, []).append(t)
    for tid in held:
        published = by_task.get(tid, [])
        assert len(published) == 1, (tid, len(published))
        assert published[0].gateway_id == "gateway-0"
        # Taken over once idle for gym_gateway.reclaim_idle_s, not left for a later restart.
        assert published[0].started_at - fault.began_at < RECLAIM_IDLE_S + 30


def test_a_killed_generators_sessions_fail_over_and_the_refits_drop_it(chaos):
    run, faults, _, _, trajectories, _ = chaos
    fault = faults["generator_kill"]
    moved = [t for t in trajectories if t.metrics.get("failovers", 0) >= 1 or t.metrics.get("attempts", 1) > 1]
    assert moved, "no session was on the killed generator"
    for t in moved:
        assert t.turns[-1].generator_id == "generator-0"
    after = [r for r in run.records() if r.get("kind") == "train" and r["time"] > fault.ended_at + 15]
    assert after and all(r["refit"]["generators"] == ["generator-0"] for r in after)
    dropped = {g for r in run.records() if r.get("kind") == "train" for g in r["refit"]["dropped_generators"]}
    assert dropped <= {"generator-1"}


def test_after_a_redis_restart_every_service_reconnects_and_no_entry_is_lost(chaos):
    run, faults, _, _, trajectories, _ = chaos
    fault = faults["redis_restart"]
    before, after = fault.details["before"], fault.details["after_restart"]
    for stream in ("tasks", "trajectories"):
        assert before[stream] and after[stream][: len(before[stream])] == before[stream]
    # Within the services' reconnect budget: a client still retrying past it would have failed its
    # service (and a crash fails the run's other checks).
    assert fault.details["reconnect_s"] < REDIS_RECONNECT_BUDGET_S
    assert len(trajectories) >= len(before["trajectories"])


def test_a_frozen_redis_stalls_the_run_without_loss_or_hang(chaos):
    run, faults, _, _, _, _ = chaos
    fault = faults["redis_pause"]
    assert fault.ended_at - fault.began_at > K.HEARTBEAT_TTL_S  # longer than a heartbeat lives
    assert fault.details["recover_s"] < REDIS_RECONNECT_BUDGET_S  # as after a restart
    records = [r for r in run.records() if r.get("kind") == "train"]
    # The live generator was silent only because Redis was: no refit dropped it.
    assert all("generator-0" not in r["refit"]["dropped_generators"] for r in records)
    # No hang: training went on soon after Redis answered again.
    assert min(r["time"] for r in records if r["time"] > fault.ended_at) - fault.ended_at < 60.0


@long_variant
def test_long_variant_survives_longer_outages(tmp_path_factory, tiny_model_dir):
    steps = 14
    run, faults, rc, crashed, trajectories, pending = _chaos_run(
        tmp_path_factory.mktemp("chaos-long"), tiny_model_dir, steps=steps, redis_down_s=6.0, redis_pause_s=35.0
    )
    assert rc == 0, run.logs()
    assert_every_step_trained_once(run.records(), steps, PROMPTS * GENS)
    assert crashed == [], run.logs()  # no fault took down a service it was not aimed at
    assert max(Counter(t.task_id for t in trajectories).values()) == 1
    assert pending == 0

"""The trainer's REST API on an opened control plane (tiny policy loaded, real Valkey), and the
pause epochs it relies on."""

from __future__ import annotations

import uuid

import pytest

from shared import keys as K
from shared.pause import PauseControl, PauseReason, launch_gate_closed
from shared.registry import publish_heartbeat
from shared.streams import connect
from tests.support.messages import make_heartbeat, make_trajectory
from tests.support.trainer import opened_plane, trainer_config

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(tiny_model_dir, redis_url, tmp_path):
    cfg = trainer_config(tmp_path, redis_url, tiny_model_dir, "api")
    async with opened_plane(cfg) as plane:
        yield plane


async def test_pause_and_resume_with_epochs(api):
    rt, client = api
    first = (await client.post("/pause")).json()["epoch"]
    assert (await rt.pause.reasons())["user"] == first
    second = (await client.post("/pause")).json()["epoch"]
    assert second > first
    # a stale resume (the first pause's epoch) cannot end the newer pause
    r = await client.post("/resume", json={"epoch": first})
    assert r.status_code == 409 and r.json()["error"]["param"] == "epoch"
    assert "user" in await rt.pause.reasons()
    assert (await client.post("/resume", json={"epoch": second})).json() == {"resumed": True, "epoch": second}
    assert await rt.pause.reasons() == {}
    assert (await client.post("/resume")).json()["resumed"] is False


async def test_resume_body_is_validated(api):
    _, client = api
    r = await client.post("/resume", json={"epoch": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "epoch"
    r = await client.post("/resume", json={"epochs": 3})
    assert r.status_code == 400


async def test_validate_is_queued_for_the_next_step_boundary(api):
    rt, client = api
    body = (await client.post("/validate")).json()
    vid = body["validation_id"]
    assert body["at_step"] == 0 and body["result_url"] == f"/validations/{vid}"
    assert (await client.get(f"/validations/{vid}")).json() == {
        "validation_id": vid,
        "status": "queued",
        "requested_at_step": 0,
    }
    assert rt.validation.due(1) == [vid]  # taken at the next step boundary, once
    assert rt.validation.due(2) == []


async def test_once_the_run_ended_a_validation_request_is_refused_and_a_queued_one_says_it_was_dropped(api):
    rt, client = api
    vid = (await client.post("/validate")).json()["validation_id"]
    rt.validation.close("the run failed: RuntimeError: boom")
    dropped = (await client.get(f"/validations/{vid}")).json()
    assert dropped["status"] == "dropped" and dropped["error"] == "the run failed: RuntimeError: boom"
    refused = await client.post("/validate")
    assert refused.status_code == 409 and "no more validations: the run failed" in refused.json()["error"]["message"]


async def test_status_and_metrics(api):
    rt, client = api
    await publish_heartbeat(rt.redis, rt.keys, make_heartbeat("gen-0", state="failed", error="engine died"))
    s = (await client.get("/status")).json()
    assert s["step"] == 0 and s["max_num_steps"] == 100 and s["weight_version"] == -1
    [gen] = [w for w in s["workers"] if w["id"] == "gen-0"]  # with its health (shared.fleet_health)
    assert gen["health"] == "lost" and gen["health_reason"] == "its heartbeat says failed: engine died"
    ready = await client.get("/ready")
    assert ready.status_code == 503 and ready.json()["weight_version"] == -1  # no weights confirmed yet
    text = (await client.get("/metrics")).text
    assert "streamrl_trainer_step" in text and "streamrl_event_loop_lag_seconds" in text


async def test_gateway_gate_reasons_follow_pause_reasons(redis_url):
    redis = connect(redis_url)
    keys = K.RunKeys(f"gate-{uuid.uuid4().hex[:6]}")
    pc = PauseControl(redis, keys)
    e = await pc.pause(PauseReason.VALIDATION)
    reasons = {r.decode() for r in await redis.hkeys(keys.pause)}
    assert reasons == {"validation"} and not await launch_gate_closed(redis, keys)  # training issue only
    r = await pc.pause(PauseReason.REFIT)
    assert "refit" in {x.decode() for x in await redis.hkeys(keys.pause)} and await launch_gate_closed(redis, keys)
    assert await pc.resume(PauseReason.REFIT, r) and await pc.resume(PauseReason.VALIDATION, e)
    await redis.aclose()


def _group_rows(group: str, target: int, version: int, size: int = 2):
    from shared.protocol import make_turn

    turn = make_turn(
        prompt_ids=[1, 2], context_len=0, generated_ids=[3], generated_logprobs=[-0.5], weight_version=version
    )
    return [
        make_trajectory(
            f"{group}/{i}",
            [turn],
            group_size=size,
            env="crossing",
            target_step=target,
            launch_version=version,
            reward=float(i),
        )
        for i in range(size)
    ]


async def test_a_step_that_evicts_and_then_samples_issues_no_tasks_for_itself(api):
    rt, _ = api
    rt.step = 2
    for n, (gid, target, version) in enumerate((("stale", 1, 0), ("cur-a", 2, 1), ("cur-b", 2, 1))):
        for k, t in enumerate(_group_rows(gid, target, version)):
            rt.buffer.add(t, f"{n + 1}-{k}")
    sample = await rt.collector.wait_for_batch(2)
    assert sorted(g.group_id for g in sample.groups) == ["cur-a", "cur-b"]
    assert [g.group_id for g in sample.evicted] == ["stale"]
    # the step is served: re-issuing its target now would only make a batch no step can use
    assert await rt.redis.xlen(rt.keys.tasks) == 0

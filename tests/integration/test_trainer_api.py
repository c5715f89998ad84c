"""The trainer's REST API on a started TrainerRuntime (tiny policy loaded, real Valkey), and the
pause epochs it relies on."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from services.trainer.app import build_app
from services.trainer.control import PauseControl
from services.trainer.runtime import TrainerRuntime
from shared import keys as K
from shared.config import decode_tree
from shared.metrics import ServiceMetrics
from shared.run_config import RunConfig
from shared.streams import connect

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(tiny_model_dir, redis_url, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"env": "crossing", "instance": {"light": c}}) + "\n" for c in ("red", "green")))
    cfg = decode_tree({
        "run": {"run_id": f"api-{uuid.uuid4().hex[:8]}", "output_dir": str(tmp_path / "out")},
        "redis": {"url": redis_url},
        "data": {"train_path": str(data), "val_path": str(data)},
        "policy": {"model_name": str(tiny_model_dir)},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
    }, RunConfig)
    cfg.check()
    rt = TrainerRuntime(cfg, worker_id="trainer-test", url="http://test")
    await rt.start()
    app = build_app(rt, ServiceMetrics("trainer"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
        yield rt, client
    await rt.aclose()


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
    assert body["at_step"] == 0 and body["validation_id"] in rt.validation_requests


async def test_status_and_metrics(api):
    _, client = api
    s = (await client.get("/status")).json()
    assert s["step"] == 0 and s["max_num_steps"] == 100 and s["weight_version"] == -1
    assert (await client.get("/ready")).status_code == 503  # no weights confirmed yet
    text = (await client.get("/metrics")).text
    assert "streamrl_trainer_step" in text and "streamrl_event_loop_lag_seconds" in text


async def test_gateway_gate_reasons_follow_pause_reasons(redis_url):
    redis = connect(redis_url)
    keys = K.RunKeys(f"gate-{uuid.uuid4().hex[:6]}")
    pc = PauseControl(redis, keys)
    e = await pc.pause("validation")
    reasons = {r.decode() for r in await redis.hkeys(keys.pause)}
    assert not reasons & set(K.LAUNCH_GATE_REASONS)  # validation pauses training issue only
    r = await pc.pause("refit")
    assert "refit" in {x.decode() for x in await redis.hkeys(keys.pause)}
    assert await pc.resume("refit", r) and await pc.resume("validation", e)
    await redis.aclose()

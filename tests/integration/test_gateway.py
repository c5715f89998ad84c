"""Gym gateway against real parts: a generator (transformers engine) and the gateway served by
uvicorn on loopback ports, a real Valkey, tasks and trajectories through the streams.

Covers the session proxy's token-exact recording across turns, task -> trajectory -> ack, the
launch gate, failure classification, dead-lettering of bad task entries, and HTTP errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest
import uvicorn
import yaml

from shared import keys as K
from shared.config import load
from shared.protocol import SamplingParams, Task, Trajectory, WeightAck, WeightAnnouncement
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect
from shared.weights_format import checksum_dir, dir_num_bytes
from streamrl.redis_server import free_port

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def serve(app, port: int):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


@pytest.fixture
async def stack(tiny_model_dir, redis_url, tmp_path):
    """Valkey + generator (weights v0 confirmed) + gateway; yields (gateway app, streams, gateway url)."""
    from services.generator.app import build_app as build_generator
    from services.gym_gateway.app import build_app as build_gateway

    run_id = f"gw-{uuid.uuid4().hex[:8]}"
    tree = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path)},
        "redis": {"url": redis_url},
        "data": {"train_path": "unused.jsonl"},
        "policy": {"model_name": str(tiny_model_dir), "generation": {
            "backend": "transformers", "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12}},
        "env": {"name": "crossing", "max_turns": 2},
        "gym_gateway": {"max_concurrent_rollouts": 4, "rollout_timeout_s": 60, "reclaim_idle_s": 600},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load(RunConfig, path, env={})
    redis = connect(redis_url)
    streams = StreamClient(redis, K.RunKeys(run_id), "test-trainer")
    await streams.ensure_group(streams.keys.trajectories, K.TRAINER_GROUP)
    gen_port, gw_port = free_port(), free_port()
    async with serve(build_generator(cfg, "gen-0", gen_port), gen_port):
        ann = WeightAnnouncement(version=0, path=str(tiny_model_dir), checksum=checksum_dir(tiny_model_dir),
                                 num_bytes=dir_num_bytes(tiny_model_dir))
        await streams.publish(streams.keys.weights, ann)
        await _wait_ack(streams, 0)
        gateway = build_gateway(cfg, worker_id="gw-0", port=gw_port, drain_timeout_s=5)
        async with serve(gateway, gw_port) as gw_url:
            yield gateway, streams, gw_url
    await redis.aclose()


async def _wait_ack(streams: StreamClient, version: int, timeout_s: float = 60) -> WeightAck:
    deadline = asyncio.get_running_loop().time() + timeout_s
    cursor = "0-0"
    while asyncio.get_running_loop().time() < deadline:
        for d in await streams.read_after(streams.keys.weight_acks, cursor, WeightAck, block_ms=200):
            cursor = d.entry_id
            if d.msg.version == version:
                assert d.msg.ok, d.msg.error
                return d.msg
    raise TimeoutError(f"no ack for v{version}")


def _task(i: int, env: str = "crossing", instance=None) -> Task:
    return Task(task_id=f"g{i}/0", group_id=f"g{i}", index_in_group=0, group_size=1, prompt_index=i, env=env,
                instance=instance or {"light": "red"}, kind="train", target_step=0,
                sampling=SamplingParams(max_tokens=12), deadline_s=60.0)


async def _collect(streams: StreamClient, n: int, timeout_s: float = 60) -> list[Trajectory]:
    out: list[Trajectory] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(out) < n and asyncio.get_running_loop().time() < deadline:
        got = await streams.read_group(streams.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=10, block_ms=200)
        out += [d.msg for d in got]
    return out


async def test_tasks_become_trajectories_and_are_acked_after_publishing(stack):
    cfg, streams, _ = stack
    await streams.publish_many(streams.keys.tasks, [_task(i) for i in range(3)])
    trajs = await _collect(streams, 3)
    assert sorted(t.task_id for t in trajs) == ["g0/0", "g1/0", "g2/0"]
    for t in trajs:
        assert t.status == "ok" and t.launch_version == 0 and t.turns
        assert t.turns[0].context_len == 0 and len(t.turns[0].generated()) > 0
        assert len(t.turns[0].generated()) == len(t.turns[0].logprobs())
    await asyncio.sleep(0.2)
    assert (await streams.redis.xpending(streams.keys.tasks, K.GATEWAYS_GROUP))["pending"] == 0


async def test_session_proxy_records_token_exact_multi_turn_history(stack):
    gateway, _, gw_url = stack
    from services.gym_gateway.envs.crossing import LOOK_TOOL

    # open a session the way the worker does, then drive it over HTTP like a black-box agent
    session = await gateway.state.proxy.open("agent-1", "train", SamplingParams(max_tokens=12))
    msgs = [{"role": "user", "content": "Look at the light, then decide."}]
    async with httpx.AsyncClient(base_url=f"{gw_url}/sessions/agent-1/v1", timeout=60) as http:
        r1 = (await http.post("/chat/completions", json={"messages": msgs, "tools": [LOOK_TOOL]})).json()
        text1 = r1["choices"][0]["message"].get("content") or ""
        # the agent sends back an edited text of the model's turn: the tokens must still be the model's
        msgs += [{"role": "assistant", "content": text1 + "  edited"},
                 {"role": "user", "content": "The light is red."}]
        r2 = (await http.post("/chat/completions", json={"messages": msgs, "tools": [LOOK_TOOL]})).json()
    t1, t2 = session.turns
    seen = list(t1.prompt()) + list(t1.generated())
    assert r2["prompt_token_ids"][: len(seen) - 1] == seen[:-1] or r2["prompt_token_ids"][: len(seen)] == seen
    assert t2.context_len == len(seen) and session.prefix_breaks == 0
    assert list(t2.prompt()) == r2["prompt_token_ids"][len(seen):]
    assert t1.weight_version == t2.weight_version == 0


async def test_prefix_break_is_detected_when_history_is_rewritten(stack):
    gateway, _, gw_url = stack
    session = await gateway.state.proxy.open("agent-2", "train", SamplingParams(max_tokens=8))
    async with httpx.AsyncClient(base_url=f"{gw_url}/sessions/agent-2/v1", timeout=60) as http:
        await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "first question"}]})
        # a new conversation in the same session: no assistant turn replayed, prompt diverges
        await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "another topic"}]})
    assert session.prefix_breaks == 1
    assert session.turns[1].context_len < len(session.turns[0].prompt())


async def test_launch_gate_holds_new_rollouts_until_reopened(stack):
    _, streams, _ = stack
    await streams.redis.hset(streams.keys.pause, "user", "1")
    await asyncio.sleep(0.5)  # the worker sees the gate before the task arrives
    await streams.publish(streams.keys.tasks, _task(7))
    assert await _collect(streams, 1, timeout_s=2.0) == []
    await streams.redis.hdel(streams.keys.pause, "user")
    assert [t.task_id for t in await _collect(streams, 1)] == ["g7/0"]


async def test_failures_are_classified_and_bad_entries_dead_lettered(stack):
    _, streams, _ = stack
    await streams.redis.xadd(streams.keys.tasks, {K.ENTRY_FIELD: b"not a task"})
    await streams.publish(streams.keys.tasks, _task(8, env="no_such_env"))
    await streams.publish(streams.keys.tasks, _task(9, instance={"light": "purple"}))
    trajs = {t.task_id: t for t in await _collect(streams, 2)}
    assert trajs["g8/0"].status == "failed" and trajs["g8/0"].fallback_reason.startswith("unknown_env")
    assert trajs["g9/0"].status == "failed" and trajs["g9/0"].fallback_reason.startswith("env_error")
    assert await streams.redis.xlen(streams.keys.deadletter) == 1


async def test_proxy_http_errors_name_the_problem(stack):
    _, _, gw_url = stack
    async with httpx.AsyncClient(base_url=gw_url, timeout=30) as http:
        r = await http.post("/sessions/nope/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
        r = await http.post("/sessions/nope/v1/chat/completions", json={"messages": "hello"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert (await http.get("/ready")).status_code == 200
        assert "streamrl_gateway_model_calls_total" in (await http.get("/metrics")).text

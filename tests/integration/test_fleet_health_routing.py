"""Generator fleet health against real parts: a real gateway (its pool and session proxy) and three
scripted generators on loopback ports over the session's Valkey, one of them answering 500s or
slowly. After some calls the gateway stops routing new sessions to it, `fleet_health` read from
Redis says it is degraded and why, and the gateway's /metrics shows the state."""

from __future__ import annotations

import contextlib
import re
import time
import uuid

import httpx
import pytest

from services.gym_gateway.app import build_app as build_gateway
from shared import keys as K
from shared.fleet_health import CallSummary, GeneratorHealth, HealthPolicy, fleet_health, publish_calls
from shared.http import HTTPError
from shared.openai_api import ChatCompletionRequest, ChatMessage
from shared.protocol import SamplingParams, decode
from shared.streams import connect
from streamrl.redis_server import free_port
from tests.support.fakes.generator import Refuse, ScriptedGenerator, say
from tests.support.gateway import load_tree, run_tree, serve, trainer_side
from tests.support.messages import make_heartbeat

pytestmark = pytest.mark.integration

POLICY = HealthPolicy(min_calls=5, publish_s=0.2)  # judged after 5 calls, re-read 5 times a second


def _answer(messages):
    return say("ok")


def _refuse(messages):
    raise Refuse(500, "CUDA error: out of memory")


@pytest.mark.parametrize("fault", ["errors", "slow"])
async def test_the_gateway_stops_routing_to_a_degraded_generator(redis_url, tmp_path, fault):
    run_id = f"fh-{uuid.uuid4().hex[:8]}"
    cfg = load_tree(run_tree("scripted-policy", redis_url, tmp_path, run_id), tmp_path / f"{run_id}.yaml")
    sick = ScriptedGenerator({"s": _refuse}) if fault == "errors" else ScriptedGenerator({"s": _answer}, delay_s=0.2)
    fleet = {"gen-a": ScriptedGenerator({"s": _answer}), "gen-b": ScriptedGenerator({"s": _answer}), "gen-c": sick}
    async with trainer_side(cfg, redis_url) as (redis, streams), contextlib.AsyncExitStack() as stack:
        for gid, gen in fleet.items():
            await stack.enter_async_context(gen.serving(serve, redis, streams.keys, worker_id=gid))
        port = free_port()
        gateway = build_gateway(cfg, worker_id="gw-0", port=port)
        url = await stack.enter_async_context(serve(gateway, port))
        proxy = gateway.state.proxy
        pool = proxy.pool
        pool.health_policy, pool.refresh_s = POLICY, 0.1

        async def session(i: int) -> str:
            s = await proxy.open(f"s-{i}", "train", SamplingParams(max_tokens=4))
            with contextlib.suppress(HTTPError):  # gen-c's 500s reach the agent unchanged
                await proxy.chat(s.session_id, ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")]))
            proxy.close(s.session_id)
            return s.generator_id

        deadline, i = time.monotonic() + 30, 0
        while getattr(pool.health.get("gen-c"), "state", None) != "degraded":
            assert time.monotonic() < deadline, f"gen-c never degraded: {pool.health}"
            await session(i)
            i += 1
        assert sick.calls >= POLICY.min_calls

        # every new session now goes to the healthy ones, and they are still served
        assert {await session(i + k) for k in range(9)} == {"gen-a", "gen-b"}
        # never route to nobody: with only gen-c left, sessions go to it
        assert (await pool.pick(wait_s=1, exclude=frozenset({"gen-a", "gen-b"})))[0] == "gen-c"

        health = await fleet_health(redis, streams.keys, policy=POLICY, record=False)
        c = health["gen-c"]
        assert c.state == "degraded" and health["gen-a"].state == health["gen-b"].state == "serving"
        if fault == "errors":
            assert re.fullmatch(r"errors (\d+)/\1 calls in the last 60 s", c.reason), c.reason
        else:
            assert c.latency_factor is not None and c.latency_factor > POLICY.slow_factor
            assert c.reason == f"{c.latency_factor:.1f}x the fleet's median latency per token"

        async with httpx.AsyncClient(base_url=url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'streamrl_gateway_generator_health{generator="gen-c",state="degraded"} 1.0' in metrics
        assert 'streamrl_gateway_generator_health{generator="gen-a",state="serving"} 1.0' in metrics


async def test_the_verdicts_are_the_fleets_memory_in_redis(redis_url):
    """A verdict one reader records is what the next reader starts from (hysteresis across
    readers); a drained generator that left and summaries nobody refreshes are deleted."""
    redis = connect(redis_url)
    keys = K.RunKeys(f"fh-{uuid.uuid4().hex[:8]}")
    now = time.time()

    def window(gid: str, latency_s: float, at: float, state: str = "ready") -> CallSummary:
        return CallSummary(
            gateway_id="gw-0",
            worker_id=gid,
            calls=20,
            errors=0,
            latency_calls=20,
            latency_median_s=latency_s,
            window_end=at,
            heartbeat_state=state,
        )

    beats = [make_heartbeat(g, weight_version=0) for g in ("g0", "g1", "g2")]
    await publish_calls(redis, keys, [window("g0", 0.01, now), window("g1", 0.01, now), window("g2", 0.1, now)])
    assert (await fleet_health(redis, keys, now=now, heartbeats=beats))["g2"].state == "degraded"
    # healthy again, read by another reader: still degraded, the recovery clock in Redis
    await publish_calls(redis, keys, [window("g2", 0.01, now + 5)])
    assert (await fleet_health(redis, keys, now=now + 5, heartbeats=beats))["g2"].state == "degraded"
    h = await fleet_health(redis, keys, now=now + 20, heartbeats=beats, record=False)
    assert h["g2"].state == "degraded" and h["g2"].reason.startswith("recovering: healthy for 15 s of 30 s")
    assert (await fleet_health(redis, keys, now=now + 40, heartbeats=beats, record=False))["g2"].state == "serving"
    assert decode(await redis.hget(keys.generator_health, "g2"), GeneratorHealth).state == "degraded"  # read only
    assert (await fleet_health(redis, keys, now=now + 40, heartbeats=beats))["g2"].state == "serving"
    assert decode(await redis.hget(keys.generator_health, "g2"), GeneratorHealth).state == "serving"
    # g1 drains and leaves: forgotten, not lost; g0's summary goes stale and is deleted
    draining = [beats[0], make_heartbeat("g1", state="draining"), beats[2]]
    assert (await fleet_health(redis, keys, now=now + 41, heartbeats=draining))["g1"].state == "draining"
    health = await fleet_health(redis, keys, now=now + 200, heartbeats=[beats[0], beats[2]])
    assert sorted(health) == ["g0", "g2"] and sorted(await redis.hkeys(keys.generator_health)) == [b"g0", b"g2"]
    assert await redis.hkeys(keys.generator_calls) == []
    await redis.aclose()

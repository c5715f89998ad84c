"""The gateway section of ``streamrl bench``: what the session proxy costs per model call.

One vLLM generator process (tiny model) and one gym-gateway process over an embedded Valkey. Two
ways of running the same multi-turn conversations, ``SESSIONS`` at once, alternated over
``ROUNDS`` so machine drift hits both (`streamrl.bench.gateway_rounds`): through the session
proxy, this process playing the external agent of each session, and straight to the generator
with the same client code.

Reported: errors on both sides (target: zero), call latency p50/p99 both ways, proxy overhead per
call p50/p99, and the gateway's memory per open session: its RSS once every conversation of a
round is over but all sessions are still open, minus its RSS before the round, over the number of
sessions. `gateway_benchmark` returns the section's `GatewayResults`, rendered by
``templates/gateway.md.jinja``. Called by `streamrl.bench.suite`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrl.bench.gateway_rounds import (
    ENV_NAME,
    MAX_TOKENS,
    SESSIONS,
    TURNS,
    DirectRound,
    ProxyRound,
    direct_round,
    proxy_round,
    publish_weights,
)
from streamrl.bench.generator_process import ROOT, GeneratorProcess, generator_config
from streamrl.bench.report import Results, render
from streamrl.child_guard import guarded

ROUNDS = 2


class Percentiles(msgspec.Struct):
    """Seconds; None when no call was timed."""

    p50: float | None
    p99: float | None


class GatewayResults(Results):
    date: str
    machine: str
    sessions: int
    turns: int  # chat calls per session
    max_tokens: int  # per call
    rounds: int  # each way
    calls_proxy: int
    errors_proxy: int
    calls_direct: int
    errors_direct: int
    latency_proxy: Percentiles  # the agent's time for a call
    latency_direct: Percentiles
    overhead: Percentiles  # the agent's time minus the upstream time the proxy recorded
    overhead_over_direct_p50: float | None  # overhead p50 over the direct call's p50 latency
    latency_ratio_p50: float | None  # proxy p50 over direct p50
    wall_s_proxy: float  # a round's, median
    wall_s_direct: float
    memory_per_session_kb: float | None  # median over the rounds
    rss_before_mb: float  # the gateway's before the sessions opened (the smallest)
    rss_open_mb: float  # with every session open (the largest)


def config_tree(model_dir: Path, redis_url: str, run_id: str, out: Path) -> dict[str, Any]:
    """The run config tree (YAML) of the generator and the gateway."""
    tree = generator_config(model_dir, redis_url, run_id, MAX_TOKENS)
    tree["policy"]["generation"]["vllm_cfg"].update(max_num_seqs=SESSIONS, max_model_len=2048)
    tree["run"]["output_dir"] = str(out)
    tree["env"] = {"name": ENV_NAME, "max_turns": TURNS}
    tree["gym_gateway"] = {
        "max_concurrent_rollouts": SESSIONS,
        "rollout_timeout_s": 600,
        "request_timeout_s": 300,
        "reclaim_idle_s": 3600,
    }
    return tree


def _start_gateway(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "streamrl.bench.gateway_rounds", "serve-gateway", "--config", str(config)]
    cmd += ["--port", str(port), "--worker-id", "gw-bench"]
    with open(log, "wb") as out:
        return subprocess.Popen(guarded(cmd), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(gateway: subprocess.Popen[bytes]) -> None:
    gateway.terminate()
    try:
        gateway.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(gateway.pid, 9)


async def _rounds(
    gen: GeneratorProcess, gateway_pid: int, redis_url: str, run_id: str
) -> tuple[list[ProxyRound], list[DirectRound]]:
    """A warm-up each way (imports, pools, caches), then ROUNDS rounds each way, alternated."""
    import aiohttp

    from streamrl.demo import MODEL_DIR

    async with aiohttp.ClientSession() as http:
        await gen.wait_ready(http)
    await publish_weights(redis_url, run_id, MODEL_DIR.resolve())
    warm_up = min(32, SESSIONS)  # no more than the gateway's slots: the agent waits for every session
    await proxy_round(redis_url, run_id, "warmup", gateway_pid, warm_up)
    await direct_round(gen.url, warm_up)
    proxy, direct = [], []
    for k in range(ROUNDS):
        direct.append(await direct_round(gen.url, SESSIONS))
        proxy.append(await proxy_round(redis_url, run_id, f"r{k}", gateway_pid, SESSIONS))
    return proxy, direct


def gateway_benchmark(work: Path, redis_url: str, machine: str) -> GatewayResults:
    """Both ways over ROUNDS alternated rounds."""
    import shutil

    from streamrl.demo import MODEL_DIR
    from streamrl.model_builder import build_tiny_model, is_model_dir
    from streamrl.redis_server import free_port

    if not is_model_dir(MODEL_DIR):
        build_tiny_model(MODEL_DIR)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run_id = f"bench-gw-{uuid.uuid4().hex[:6]}"
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump(config_tree(MODEL_DIR, redis_url, run_id, work)))
    gen = GeneratorProcess(config, free_port(), work / "generator.log")
    gateway = _start_gateway(config, free_port(), work / "gateway.log")
    try:
        proxy, direct = asyncio.run(_rounds(gen, gateway.pid, redis_url, run_id))
    finally:
        _stop(gateway)
        gen.stop()
    return summarize(proxy, direct, date=time.strftime("%Y-%m-%d"), machine=machine)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _percentiles(xs: list[float]) -> Percentiles:
    return Percentiles(_pct(xs, 0.5), _pct(xs, 0.99))


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(proxy: list[ProxyRound], direct: list[DirectRound], *, date: str, machine: str) -> GatewayResults:
    """The section's figures from the rounds of both ways."""
    latency_proxy = _percentiles([x for r in proxy for x in r.client_s])
    latency_direct = _percentiles([x for r in direct for x in r.client_s])
    overhead = _percentiles([x for r in proxy for x in r.overhead_s])
    per_session_kb = [(r.rss_open_kb - r.rss_before_kb) / SESSIONS for r in proxy if r.rss_open_kb]
    return GatewayResults(
        date=date,
        machine=machine,
        sessions=SESSIONS,
        turns=TURNS,
        max_tokens=MAX_TOKENS,
        rounds=len(proxy),
        calls_proxy=sum(r.calls for r in proxy),
        errors_proxy=sum(r.errors for r in proxy),
        calls_direct=sum(r.calls for r in direct),
        errors_direct=sum(r.errors for r in direct),
        latency_proxy=latency_proxy,
        latency_direct=latency_direct,
        overhead=overhead,
        overhead_over_direct_p50=_over(overhead.p50, latency_direct.p50),
        latency_ratio_p50=_over(latency_proxy.p50, latency_direct.p50),
        wall_s_proxy=statistics.median(r.wall_s for r in proxy),
        wall_s_direct=statistics.median(r.wall_s for r in direct),
        memory_per_session_kb=statistics.median(per_session_kb) if per_session_kb else None,
        rss_before_mb=min((r.rss_before_kb for r in proxy), default=0) / 1024,
        rss_open_mb=max((r.rss_open_kb for r in proxy), default=0) / 1024,
    )


def render_section(r: GatewayResults) -> str:
    return render("gateway", r=r)

"""The gateway section of ``streamrl bench``: what the session proxy costs per model call.

One vLLM generator process (tiny model) and one gym-gateway process over an embedded Valkey. Two
ways of running the same multi-turn conversations, ``SESSIONS`` at once, alternated over
``ROUNDS`` so machine drift hits both:

* **through the proxy**: tasks of the ``bench_chat`` environment go through the tasks stream; the
  gateway's worker opens a session for each and the environment hands the session URL to this
  process (a Redis list), which plays an external agent: it holds the conversation over HTTP
  against `/sessions/<id>/v1/chat/completions` (the proxy attaches the token history, forwards,
  records the turns), then tells the environment it is done; trajectories come back on the
  stream. The agent times each call; the proxy records the upstream time of the same call
  (``Turn.latency_s``): their difference is the proxy's overhead per call.
* **direct**: this process sends the same conversations straight to the generator with the same
  client code, carrying the token history itself (``required_prefix_token_ids``), as the proxy
  does.

Reported: errors on both sides (target: zero), call latency p50/p99 both ways, proxy overhead per
call p50/p99, and the gateway's memory per open session: its RSS once every conversation of a
round is over but all sessions are still open, minus its RSS before the round, over the number of
sessions.

``python -m streamrl.bench.gateway serve-gateway ARGS`` is the gateway process: the service's own
entry point with the bench environment registered. Called by `streamrl.bench`.
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
from typing import TYPE_CHECKING, Any

import yaml

from streamrl.child_guard import guarded

if TYPE_CHECKING:
    import aiohttp
    import msgspec
    import redis.asyncio as aioredis

    from services.gym_gateway.envs.base import ModelClient, Outcome
    from shared.openai_api import ChatCompletionResponse
    from shared.run_config import EnvSection

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Gym gateway"
ENV_NAME = "bench_chat"
SESSIONS = 256
TURNS = 3
MAX_TOKENS = 8
ROUNDS = 2
BARRIER_TIMEOUT_S = 120.0


def _rss_kb(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _messages(i: int, turn: int, replies: list[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Session {i}: count the apples and the pears."}]
    for k, text in enumerate(replies[:turn]):
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on ({k + 1})."}]
    return msgs


def _agent_keys(run_id: str, rnd: str) -> tuple[str, str]:
    """The list the environment pushes session URLs to, and the prefix of its per-session done keys."""
    return f"bench:{run_id}:{rnd}:sessions", f"bench:{run_id}:{rnd}:done:"


class BenchChatEnv:
    """Hands the rollout's session URL to the external agent (the bench driver) and waits until it
    says the conversation is over; the session stays open (and recorded) meanwhile. It plays an
    external agent, so it hands over the session's URL (``llm.base_url``), not the in-process client."""

    name = ENV_NAME

    def __init__(self) -> None:
        self._redis: aioredis.Redis | None = None

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> BenchChatEnv:
        return cls()  # plugged in as an object (`envs.registered`); nothing to configure

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [{"i": i} for i in range(n)]

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        from services.gym_gateway.envs.base import Outcome
        from shared.streams import connect

        if self._redis is None:
            # one connection per waiting rollout; a wait longer than the default socket timeout
            self._redis = connect(
                instance["redis_url"], socket_timeout_s=BARRIER_TIMEOUT_S + 10, max_connections=2 * SESSIONS + 8
            )
        sessions, done = _agent_keys(instance["run_id"], instance["round"])
        await self._redis.rpush(sessions, f"{instance['i']} {llm.base_url}")
        if await self._redis.blpop([done + str(instance["i"])], timeout=BARRIER_TIMEOUT_S) is None:
            raise TimeoutError("the bench agent never finished its conversation")
        return Outcome(reward=1.0, metrics={"i": float(instance["i"])})


def serve_gateway(argv: list[str]) -> int:
    from services.gym_gateway import envs
    from services.gym_gateway.__main__ import main

    with envs.registered(BenchChatEnv()):
        return main(argv)


# -- the driver --------------------------------------------------------------------------------


def config_tree(model_dir: Path, redis_url: str, run_id: str, out: Path) -> dict[str, Any]:
    from streamrl.bench.generator import config_tree as generator_tree

    tree = generator_tree(model_dir, redis_url, run_id)
    vllm = tree["policy"]["generation"]["vllm_cfg"]
    vllm.update(max_num_seqs=SESSIONS, max_model_len=2048)
    tree["policy"]["generation"]["max_new_tokens"] = MAX_TOKENS
    tree["run"]["output_dir"] = str(out)
    tree["env"] = {"name": ENV_NAME, "max_turns": TURNS}
    tree["gym_gateway"] = {
        "max_concurrent_rollouts": SESSIONS,
        "rollout_timeout_s": 600,
        "request_timeout_s": 300,
        "reclaim_idle_s": 3600,
    }
    return tree


async def _publish_weights(redis_url: str, run_id: str, model_dir: Path) -> None:
    from shared import keys as K
    from shared.protocol import WeightAck, WeightAnnouncement
    from shared.streams import StreamClient, connect
    from shared.weights_format import checksum_dir, dir_num_bytes

    redis = connect(redis_url)
    streams = StreamClient(redis, K.RunKeys(run_id), "bench")
    try:
        await streams.publish(
            streams.keys.weights,
            WeightAnnouncement(
                version=0, path=str(model_dir), checksum=checksum_dir(model_dir), num_bytes=dir_num_bytes(model_dir)
            ),
        )
        deadline = time.monotonic() + 300
        cursor = "0-0"
        while time.monotonic() < deadline:
            for d in await streams.read_after(streams.keys.weight_acks, cursor, WeightAck, block_ms=500):
                cursor = d.entry_id
                ack = d.msg  # None: an unreadable entry, dead-lettered
                if ack is not None and ack.version == 0:
                    if not ack.ok:
                        raise RuntimeError(f"generator refused weights v0: {ack.error}")
                    return
        raise RuntimeError("generator did not confirm weights v0")
    finally:
        await redis.aclose()


async def _conversation(
    http: aiohttp.ClientSession,
    base_url: str,
    i: int,
    *,
    direct: bool,
    decoder: msgspec.json.Decoder[ChatCompletionResponse],
) -> list[float] | None:
    """TURNS chat calls, timed; the token history is carried here only when calling the generator
    directly (the proxy attaches it itself). None on an error."""
    import msgspec

    replies: list[str] = []
    context: list[int] = []
    lat: list[float] = []
    for turn in range(TURNS):
        body: dict[str, Any] = {"messages": _messages(i, turn, replies), "max_tokens": MAX_TOKENS}
        if direct:
            body.update(temperature=0.8, top_p=1.0, streamrl={"kind": "train"})
            if context:
                body["required_prefix_token_ids"] = context
        t0 = time.perf_counter()
        async with http.post(
            f"{base_url}/chat/completions", data=msgspec.json.encode(body), headers={"content-type": "application/json"}
        ) as r:
            raw = await r.read()
            if r.status != 200:
                return None
        out = decoder.decode(raw)
        lat.append(time.perf_counter() - t0)
        msg = out.choices[0].message
        context = list(out.prompt_token_ids) + list(msg.generation_token_ids)
        replies.append(msg.content or "")
    return lat


def _client(n: int) -> tuple[aiohttp.ClientSession, msgspec.json.Decoder[ChatCompletionResponse]]:
    import aiohttp
    import msgspec

    from shared.openai_api import ChatCompletionResponse

    conn = aiohttp.TCPConnector(limit=4 * n, keepalive_timeout=30.0)
    http = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300))
    return http, msgspec.json.Decoder(ChatCompletionResponse)


async def proxy_round(redis_url: str, run_id: str, rnd: str, gateway_pid: int, n: int) -> dict[str, Any]:
    """``n`` bench_chat tasks through the gateway, each conversation held by this process over the
    session URL the environment hands out; per-call client and upstream times."""
    from shared import keys as K
    from shared.protocol import SamplingParams, Task, Trajectory
    from shared.redis_replies import as_text
    from shared.streams import StreamClient, connect

    redis = connect(redis_url)
    streams = StreamClient(redis, K.RunKeys(run_id), "bench-trainer")
    await streams.ensure_group(streams.keys.trajectories, K.TRAINER_GROUP)
    sessions_key, done = _agent_keys(run_id, rnd)
    rss_before = _rss_kb(gateway_pid)
    sampling = SamplingParams(temperature=0.8, top_p=1.0, max_tokens=MAX_TOKENS)
    tasks = [
        Task(
            task_id=f"{rnd}-{i}/0",
            group_id=f"{rnd}-{i}",
            index_in_group=0,
            group_size=1,
            prompt_index=i,
            env=ENV_NAME,
            instance={"i": i, "round": rnd, "run_id": run_id, "redis_url": redis_url},
            kind="train",
            target_step=0,
            sampling=sampling,
            deadline_s=600.0,
        )
        for i in range(n)
    ]
    http, decoder = _client(n)
    lat: dict[int, list[float] | None] = {}
    t0 = time.perf_counter()
    await streams.publish_many(streams.keys.tasks, tasks)

    async def agent(i: int, url: str) -> None:
        lat[i] = await _conversation(http, url, i, direct=False, decoder=decoder)

    agents: list[asyncio.Task[None]] = []
    while len(agents) < n:
        got = await redis.blpop([sessions_key], timeout=300)
        if got is None:
            break
        index, url = as_text(got[1]).split(" ", 1)
        agents.append(asyncio.create_task(agent(int(index), url)))
    await asyncio.gather(*agents)
    wall = time.perf_counter() - t0
    rss_open = _rss_kb(gateway_pid)  # every conversation over, every session still open
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.rpush(done + str(i), b"1")
        await pipe.execute()
    got_t: list[Trajectory] = []
    deadline = time.monotonic() + 300
    while len(got_t) < n and time.monotonic() < deadline:
        for d in await streams.read_group(
            streams.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=512, block_ms=500
        ):
            got_t.append(d.msg)
            await streams.ack(streams.keys.trajectories, K.TRAINER_GROUP, [d.entry_id])
    await http.close()
    await redis.aclose()
    timed = {i: calls for i, calls in lat.items() if calls}  # conversations that ended without an error
    ok = [t for t in got_t if t.status == "ok" and len(t.turns) == TURNS and int(t.metrics["i"]) in timed]
    client = [x for t in ok for x in timed[int(t.metrics["i"])]]
    upstream = [turn.latency_s for t in ok for turn in t.turns]
    overhead = [timed[int(t.metrics["i"])][k] - t.turns[k].latency_s for t in ok for k in range(TURNS)]
    breaks = sum(t.metrics.get("prefix_breaks", 0) for t in got_t)
    return {
        "errors": n - len(ok) + int(breaks),
        "calls": len(client),
        "wall_s": wall,
        "client_s": client,
        "upstream_s": upstream,
        "overhead_s": overhead,
        "rss_before_kb": rss_before,
        "rss_open_kb": rss_open,
    }


async def direct_round(url: str, n: int) -> dict[str, Any]:
    """The same conversations straight to the generator, token history carried by the client."""
    http, decoder = _client(n)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[_conversation(http, f"{url}/v1", i, direct=True, decoder=decoder) for i in range(n)]
    )
    wall = time.perf_counter() - t0
    await http.close()
    lat = [x for r in results if r for x in r]
    return {"errors": sum(r is None for r in results), "calls": len(lat), "wall_s": wall, "client_s": lat}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def gateway_benchmark(work: Path, redis_url: str, machine: str) -> dict[str, Any]:
    """Both ways over ROUNDS alternated rounds; a JSON-able dict for `render_section`."""
    import shutil

    import aiohttp

    from streamrl.bench.generator import GeneratorProcess
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
    gw_port = free_port()
    gw_log = open(work / "gateway.log", "wb")
    gateway = subprocess.Popen(
        guarded(
            [
                sys.executable,
                "-m",
                "streamrl.bench.gateway",
                "serve-gateway",
                "--config",
                str(config),
                "--port",
                str(gw_port),
                "--worker-id",
                "gw-bench",
            ]
        ),
        cwd=ROOT,
        stdout=gw_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    async def run() -> dict[str, Any]:
        async with aiohttp.ClientSession() as http:
            await gen.wait_ready(http)
        await _publish_weights(redis_url, run_id, MODEL_DIR.resolve())
        await proxy_round(redis_url, run_id, "warmup", gateway.pid, 32)  # imports, pools, caches
        await direct_round(gen.url, 32)
        rounds: dict[str, list[dict[str, Any]]] = {"proxy": [], "direct": []}
        for k in range(ROUNDS):
            rounds["direct"].append(await direct_round(gen.url, SESSIONS))
            rounds["proxy"].append(await proxy_round(redis_url, run_id, f"r{k}", gateway.pid, SESSIONS))
        return rounds

    try:
        rounds = asyncio.run(run())
    finally:
        gateway.terminate()
        try:
            gateway.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(gateway.pid, 9)
        gw_log.close()
        gen.stop()
    return summarize(rounds, machine)


def summarize(rounds: dict[str, list[dict[str, Any]]], machine: str) -> dict[str, Any]:
    def flat(side: str, key: str) -> list[float]:
        return [x for r in rounds[side] for x in r.get(key, [])]

    proxy, direct = rounds["proxy"], rounds["direct"]
    per_session_kb = [(r["rss_open_kb"] - r["rss_before_kb"]) / SESSIONS for r in proxy if r["rss_open_kb"]]
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "sessions": SESSIONS,
        "turns": TURNS,
        "max_tokens": MAX_TOKENS,
        "rounds": len(proxy),
        "errors_proxy": sum(r["errors"] for r in proxy),
        "errors_direct": sum(r["errors"] for r in direct),
        "calls_proxy": sum(r["calls"] for r in proxy),
        "calls_direct": sum(r["calls"] for r in direct),
        "latency": {
            side: {"p50": _pct(flat(side, "client_s"), 0.5), "p99": _pct(flat(side, "client_s"), 0.99)}
            for side in ("proxy", "direct")
        },
        "overhead": {"p50": _pct(flat("proxy", "overhead_s"), 0.5), "p99": _pct(flat("proxy", "overhead_s"), 0.99)},
        "wall_s": {side: statistics.median(r["wall_s"] for r in rounds[side]) for side in ("proxy", "direct")},
        "memory_per_session_kb": statistics.median(per_session_kb) if per_session_kb else float("nan"),
        "rss_open_mb": max((r["rss_open_kb"] for r in proxy), default=0) / 1024,
        "rss_before_mb": min((r["rss_before_kb"] for r in proxy), default=0) / 1024,
    }


def render_section(g: dict[str, Any]) -> str:
    lat, ov = g["latency"], g["overhead"]
    ratio50 = lat["proxy"]["p50"] / lat["direct"]["p50"]
    lines = [
        f"{HEADING} (`streamrl bench --only gateway`: {g['sessions']} concurrent sessions x {g['turns']} chat turns, "
        f"{g['max_tokens']} tokens per call, vLLM generator on the tiny model, {g['rounds']} rounds each way, "
        f"alternated; {g['date']}, {g['machine']})",
        "",
        "| | through the session proxy | direct to the generator |",
        "|---|---|---|",
        f"| calls / errors | {g['calls_proxy']} / {g['errors_proxy']} | {g['calls_direct']} / {g['errors_direct']} |",
        f"| call latency p50 (ms) | {lat['proxy']['p50'] * 1e3:.0f} | {lat['direct']['p50'] * 1e3:.0f} |",
        f"| call latency p99 (ms) | {lat['proxy']['p99'] * 1e3:.0f} | {lat['direct']['p99'] * 1e3:.0f} |",
        f"| round wall time, median (s) | {g['wall_s']['proxy']:.1f} | {g['wall_s']['direct']:.1f} |",
        "",
        f"Proxy overhead per call (the agent's time for a call minus the upstream time the proxy recorded "
        f"for the same call): p50 {ov['p50'] * 1e3:.1f} ms, p99 {ov['p99'] * 1e3:.1f} ms; "
        f"p50 over the direct call's p50 latency: {ov['p50'] / lat['direct']['p50']:.1%}. "
        f"Latency through the proxy over direct, p50: {ratio50:.2f}x. "
        f"Gateway memory per open session: {g['memory_per_session_kb']:.0f} KiB "
        f"(baseline: RSS {g.get('rss_before_mb', float('nan')):.0f} MiB before the sessions opened, "
        f"{g['rss_open_mb']:.0f} MiB with all {g['sessions']} open). The agent (this process) holds "
        f"every conversation over HTTP in both columns, with the same client code. "
        f"Target: zero errors; {'met' if g['errors_proxy'] == 0 and g['errors_direct'] == 0 else 'NOT met'}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve-gateway":
        sys.exit(serve_gateway(sys.argv[2:]))
    sys.exit("usage: python -m streamrl.bench.gateway serve-gateway --config RUN.yaml [--port N]")

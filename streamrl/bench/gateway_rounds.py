"""The gateway section's rounds (`streamrl.bench.gateway` drives them) and the gateway process
they run against.

* **through the proxy** (`proxy_round`): tasks of the ``bench_chat`` environment go through the
  tasks stream; the gateway's worker opens a session for each and `BenchChatEnv` hands the session
  URL to the driver (a Redis list), which plays an external agent: it holds the conversation over
  HTTP against `/sessions/<id>/v1/chat/completions` (the proxy attaches the token history,
  forwards, records the turns), then tells the environment it is done; trajectories come back on
  the stream. The agent times each call; the proxy records the upstream time of the same call
  (``Turn.latency_s``): their difference is the proxy's overhead per call.
* **direct** (`direct_round`): the same conversations straight to the generator with the same
  client code, carrying the token history itself (``required_prefix_token_ids``), as the proxy does.

``python -m streamrl.bench.gateway_rounds serve-gateway ARGS`` is the gateway process: the
service's own entry point with the bench environment registered.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import aiohttp
    import redis.asyncio as aioredis

    from services.gym_gateway.envs.base import ModelClient, Outcome
    from shared.openai_api import ChatCompletionResponse
    from shared.protocol import Task, Trajectory
    from shared.sections.gateway import EnvSection
    from shared.streams import StreamClient

ENV_NAME = "bench_chat"
SESSIONS = 256
TURNS = 3
MAX_TOKENS = 8
BARRIER_TIMEOUT_S = 120.0


class ProxyRound(msgspec.Struct):
    """One round through the session proxy: per-call times of the agent, of the upstream call the
    proxy recorded, and their difference; the gateway's RSS before and with every session open."""

    errors: int
    calls: int
    wall_s: float
    client_s: list[float]
    upstream_s: list[float]
    overhead_s: list[float]
    rss_before_kb: int
    rss_open_kb: int


class DirectRound(msgspec.Struct):
    """One round straight to the generator: per-call times of the agent."""

    errors: int
    calls: int
    wall_s: float
    client_s: list[float]


def _rss_kb(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _messages(i: int, turn: int, replies: list[str]) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = [{"role": "user", "content": f"Session {i}: count the apples and the pears."}]
    for k, text in enumerate(replies[:turn]):
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on ({k + 1})."}]
    return msgs


def _agent_keys(run_id: str, rnd: str) -> tuple[str, str]:
    """The list the environment pushes session URLs to, and the prefix of its per-session done keys."""
    from shared.keys import RunKeys

    keys = RunKeys(run_id)
    return keys.env_key(ENV_NAME, rnd, "sessions"), keys.env_key(ENV_NAME, rnd, "done") + ":"


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

    async def aclose(self) -> None:
        """Close the connection the waiting rollouts shared (the gateway's shutdown)."""
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

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


# -- the agent -----------------------------------------------------------------------------------


async def publish_weights(redis_url: str, run_id: str, model_dir: Path) -> None:
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
    replies: list[str] = []
    context: list[int] = []
    lat: list[float] = []
    for turn in range(TURNS):
        body: dict[str, object] = {"messages": _messages(i, turn, replies), "max_tokens": MAX_TOKENS}
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

    from shared.openai_api import ChatCompletionResponse

    conn = aiohttp.TCPConnector(limit=4 * n, keepalive_timeout=30.0)
    http = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300))
    return http, msgspec.json.Decoder(ChatCompletionResponse)


def _tasks(redis_url: str, run_id: str, rnd: str, n: int) -> list[Task]:
    """``n`` bench_chat tasks of round ``rnd``; the instance tells the environment where to hand
    its session URL."""
    from shared.protocol import SamplingParams, Task

    sampling = SamplingParams(temperature=0.8, top_p=1.0, max_tokens=MAX_TOKENS)
    return [
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


async def _hold_sessions(redis: aioredis.Redis, sessions_key: str, n: int) -> dict[int, list[float] | None]:
    """Hold each conversation whose session URL the environment hands out, ``n`` at most; the
    timed calls of each (None: it ended with an error)."""
    from shared.redis_replies import as_text

    http, decoder = _client(n)
    lat: dict[int, list[float] | None] = {}

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
    await http.close()
    return lat


async def _trajectories(streams: StreamClient, n: int) -> list[Trajectory]:
    """Up to ``n`` trajectories read (and acknowledged) from the run's stream, within 300 s."""
    from shared import keys as K
    from shared.protocol import Trajectory

    got: list[Trajectory] = []
    deadline = time.monotonic() + 300
    while len(got) < n and time.monotonic() < deadline:
        for d in await streams.read_group(
            streams.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=512, block_ms=500
        ):
            got.append(d.msg)
            await streams.ack(streams.keys.trajectories, K.TRAINER_GROUP, [d.entry_id])
    return got


async def proxy_round(redis_url: str, run_id: str, rnd: str, gateway_pid: int, n: int) -> ProxyRound:
    """``n`` bench_chat tasks through the gateway, each conversation held by this process over the
    session URL the environment hands out; per-call client and upstream times."""
    from shared import keys as K
    from shared.streams import StreamClient, connect

    redis = connect(redis_url)
    streams = StreamClient(redis, K.RunKeys(run_id), "bench-trainer")
    await streams.ensure_group(streams.keys.trajectories, K.TRAINER_GROUP)
    sessions_key, done = _agent_keys(run_id, rnd)
    rss_before = _rss_kb(gateway_pid)
    t0 = time.perf_counter()
    await streams.publish_many(streams.keys.tasks, _tasks(redis_url, run_id, rnd, n))
    lat = await _hold_sessions(redis, sessions_key, n)
    wall = time.perf_counter() - t0
    rss_open = _rss_kb(gateway_pid)  # every conversation over, every session still open
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.rpush(done + str(i), b"1")
        await pipe.execute()
    trajectories = await _trajectories(streams, n)
    await redis.aclose()
    timed = {i: calls for i, calls in lat.items() if calls}  # conversations that ended without an error
    ok = [t for t in trajectories if t.status == "ok" and len(t.turns) == TURNS and int(t.metrics["i"]) in timed]
    breaks = sum(t.metrics.get("prefix_breaks", 0) for t in trajectories)
    client = [x for t in ok for x in timed[int(t.metrics["i"])]]
    return ProxyRound(
        errors=n - len(ok) + int(breaks),
        calls=len(client),
        wall_s=wall,
        client_s=client,
        upstream_s=[turn.latency_s for t in ok for turn in t.turns],
        overhead_s=[timed[int(t.metrics["i"])][k] - t.turns[k].latency_s for t in ok for k in range(TURNS)],
        rss_before_kb=rss_before,
        rss_open_kb=rss_open,
    )


async def direct_round(url: str, n: int) -> DirectRound:
    """The same conversations straight to the generator, token history carried by the client."""
    http, decoder = _client(n)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[_conversation(http, f"{url}/v1", i, direct=True, decoder=decoder) for i in range(n)]
    )
    wall = time.perf_counter() - t0
    await http.close()
    lat = [x for r in results if r for x in r]
    return DirectRound(errors=sum(r is None for r in results), calls=len(lat), wall_s=wall, client_s=lat)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve-gateway":
        sys.exit(serve_gateway(sys.argv[2:]))
    sys.exit("usage: python -m streamrl.bench.gateway_rounds serve-gateway --config RUN.yaml [--port N]")

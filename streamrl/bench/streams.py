"""The stream-transport section of ``streamrl bench``: token arrays packed against msgpack lists.

Side by side in one process against one embedded Valkey: trajectories of a realistic size (a
2-turn rollout, 1,000+ tokens) published and consumed through the real StreamClient (XADD,
XREADGROUP + decode + XACK), with token arrays packed as int32/float32 bytes versus the same
payload as msgpack lists of numbers (the baseline the design rejects). Run only by the whole
suite (`streamrl.bench.suite`); rendered by ``templates/streams.md.jinja``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable

import msgspec
import numpy as np

from shared import keys as K
from shared.protocol import Trajectory, encode, make_turn
from shared.redis_replies import read_entries
from shared.streams import StreamClient, connect
from streamrl.bench.report import Results, render

TRAJECTORIES = 3000
REPEATS = 3  # rounds per payload kind; the medians are reported


class StreamFigures(msgspec.Struct):
    """One payload kind (or the ratio of two): entry size and rates (trajectories per second)."""

    entry_bytes: float
    produce_per_s: float
    consume_per_s: float  # XREADGROUP + decode + XACK
    end_to_end_per_s: float

    def over(self, base: StreamFigures) -> StreamFigures:
        return StreamFigures(
            *(a / b for a, b in zip(msgspec.structs.astuple(self), msgspec.structs.astuple(base), strict=True))
        )


class StreamsResults(Results):
    packed: StreamFigures  # token arrays as int32/float32 bytes (ours)
    lists: StreamFigures  # the same payload as msgpack lists of numbers (baseline)
    packed_over_lists: StreamFigures


def _trajectory(i: int, rng: np.random.Generator, prompt_len: int = 600, gen_len: int = 300) -> Trajectory:
    turns = [
        make_turn(
            prompt_ids=rng.integers(0, 150_000, prompt_len),
            context_len=0,
            generated_ids=rng.integers(0, 150_000, gen_len),
            generated_logprobs=-rng.random(gen_len),
            weight_version=3,
        ),
        make_turn(
            prompt_ids=rng.integers(0, 150_000, 60),
            context_len=prompt_len + gen_len,
            generated_ids=rng.integers(0, 150_000, gen_len),
            generated_logprobs=-rng.random(gen_len),
            weight_version=3,
        ),
    ]
    return Trajectory(
        task_id=f"g{i}/0",
        group_id=f"g{i}",
        index_in_group=0,
        group_size=1,
        prompt_index=i,
        env="bench",
        kind="train",
        target_step=4,
        launch_version=3,
        reward=1.0,
        status="ok",
        turns=turns,
    )


class _ListTurn(msgspec.Struct):
    prompt_ids: list[int]
    generated_ids: list[int]
    generated_logprobs: list[float]


class _ListTrajectory(msgspec.Struct):
    task_id: str
    turns: list[_ListTurn]


def _as_lists(t: Trajectory) -> _ListTrajectory:
    return _ListTrajectory(
        t.task_id, [_ListTurn(x.prompt().tolist(), x.generated().tolist(), x.logprobs().tolist()) for x in t.turns]
    )


async def _stream_round(redis_url: str, payloads: list[bytes], decode: Callable[[bytes], object]) -> StreamFigures:
    redis = connect(redis_url)
    keys = K.RunKeys(f"bench-{uuid.uuid4().hex[:6]}")
    sc = StreamClient(redis, keys, "bench")
    await sc.ensure_group(keys.trajectories, K.TRAINER_GROUP)
    t0 = time.perf_counter()
    for i in range(0, len(payloads), 100):
        async with redis.pipeline(transaction=False) as pipe:
            for p in payloads[i : i + 100]:
                pipe.xadd(keys.trajectories, {K.ENTRY_FIELD: p})
            await pipe.execute()
    t1 = time.perf_counter()
    got = 0
    while got < len(payloads):
        reply = await redis.xreadgroup(K.TRAINER_GROUP, "bench", {keys.trajectories: ">"}, count=200, block=1000)
        entries = read_entries(reply)
        for _, fields in entries:
            assert fields is not None  # new entries (">") always carry their fields
            decode(fields[K.ENTRY_FIELD])
        await redis.xack(keys.trajectories, K.TRAINER_GROUP, *[e for e, _ in entries])
        got += len(entries)
    t2 = time.perf_counter()
    await redis.delete(keys.trajectories)
    await redis.aclose()
    n = len(payloads)
    return StreamFigures(float(np.mean([len(p) for p in payloads])), n / (t1 - t0), n / (t2 - t1), n / (t2 - t0))


def _median(rounds: list[StreamFigures]) -> StreamFigures:
    columns = zip(*(msgspec.structs.astuple(r) for r in rounds), strict=True)
    return StreamFigures(*(statistics.median(c) for c in columns))


def stream_benchmark(redis_url: str, n: int = TRAJECTORIES) -> StreamsResults:
    from shared.protocol import decode as decode_msg

    rng = np.random.default_rng(0)
    trajs = [_trajectory(i, rng) for i in range(n)]
    packed = [encode(t) for t in trajs]
    lists = [msgspec.msgpack.encode(_as_lists(t)) for t in trajs]
    list_decoder = msgspec.msgpack.Decoder(_ListTrajectory)
    medians = {}
    for name, payloads, dec in (
        ("packed", packed, lambda b: decode_msg(b, Trajectory)),
        ("lists", lists, list_decoder.decode),
    ):
        medians[name] = _median([asyncio.run(_stream_round(redis_url, payloads, dec)) for _ in range(REPEATS)])
    return streams_results(medians["packed"], medians["lists"])


def streams_results(packed: StreamFigures, lists: StreamFigures) -> StreamsResults:
    """Both payload kinds, and packed over lists."""
    return StreamsResults(packed=packed, lists=lists, packed_over_lists=packed.over(lists))


def render_section(r: StreamsResults) -> str:
    return render("streams", r=r, trajectories=TRAJECTORIES, repeats=REPEATS)

"""Streams client against a real Valkey server: produce, consume, ack, reclaim, touch, dead-letter."""

import asyncio
import uuid

import msgspec
import pytest

from shared import keys as K
from shared.protocol import DeadLetter, Heartbeat, Task, decode, encode
from shared.redis_replies import as_text
from shared.registry import live_workers, publish_heartbeat, remove_worker
from shared.streams import StreamClient, connect
from tests.support.messages import make_task

pytestmark = pytest.mark.integration


def _task(i: int) -> Task:
    return make_task(f"g{i}", group_size=2, prompt_index=i, instance={"i": i}, deadline_s=30.0)


@pytest.fixture
async def clients(redis_url):
    redis = connect(redis_url)
    keys = K.RunKeys(f"t-{uuid.uuid4().hex[:8]}")
    a = StreamClient(redis, keys, "worker-a")
    b = StreamClient(redis, keys, "worker-b")
    await a.ensure_group(keys.tasks, K.GATEWAYS_GROUP)
    yield a, b, keys
    await redis.aclose()


async def test_produce_consume_ack(clients):
    a, _, keys = clients
    await a.publish_many(keys.tasks, [_task(i) for i in range(5)])
    got = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=3, block_ms=100)
    assert [d.msg.prompt_index for d in got] == [0, 1, 2]
    assert await a.ack(keys.tasks, K.GATEWAYS_GROUP, [d.entry_id for d in got]) == 3
    rest = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=100)
    assert [d.msg.prompt_index for d in rest] == [3, 4]
    pending = await a.redis.xpending(keys.tasks, K.GATEWAYS_GROUP)
    assert pending["pending"] == 2


async def test_unacked_entries_are_redelivered_to_same_consumer_after_restart(clients):
    a, _, keys = clients
    await a.publish(keys.tasks, _task(1))
    first = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=1, block_ms=100)
    again = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10, pending=True)
    assert [d.entry_id for d in again] == [first[0].entry_id]


async def test_idle_pending_entries_are_reclaimed_by_another_consumer(clients):
    a, b, keys = clients
    await a.publish_many(keys.tasks, [_task(i) for i in range(3)])
    taken = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=3, block_ms=100)
    assert len(taken) == 3
    # worker-a "dies": nothing is acked. Not idle long enough yet -> nothing to reclaim.
    assert await b.reclaim(keys.tasks, K.GATEWAYS_GROUP, Task, min_idle_ms=60_000) == []
    reclaimed = await b.reclaim(keys.tasks, K.GATEWAYS_GROUP, Task, min_idle_ms=0)
    assert sorted(d.msg.prompt_index for d in reclaimed) == [0, 1, 2]
    info = await b.redis.xpending_range(keys.tasks, K.GATEWAYS_GROUP, "-", "+", 10)
    assert {i["consumer"] for i in info} == {b"worker-b"}


async def test_a_result_is_published_once_even_when_its_task_was_taken_over(clients):
    a, b, keys = clients
    await a.publish(keys.tasks, _task(1))
    (mine,) = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=1, block_ms=100)
    (theirs,) = await b.reclaim(keys.tasks, K.GATEWAYS_GROUP, Task, min_idle_ms=0)  # a looked dead
    # the slow first owner finishes late: nothing is published and b's claim stays pending
    assert await a.publish_and_ack(keys.trajectories, _task(101), keys.tasks, K.GATEWAYS_GROUP, mine.entry_id) is None
    assert await a.redis.xlen(keys.trajectories) == 0
    assert (await a.redis.xpending(keys.tasks, K.GATEWAYS_GROUP))["pending"] == 1
    out = await b.publish_and_ack(keys.trajectories, _task(102), keys.tasks, K.GATEWAYS_GROUP, theirs.entry_id)
    assert out is not None and await a.redis.xlen(keys.trajectories) == 1
    assert (await a.redis.xpending(keys.tasks, K.GATEWAYS_GROUP))["pending"] == 0
    # and a second publish for the same, now acked, entry does nothing
    assert await b.publish_and_ack(keys.trajectories, _task(103), keys.tasks, K.GATEWAYS_GROUP, theirs.entry_id) is None


async def test_touch_keeps_only_the_holders_entries_fresh(clients):
    a, b, keys = clients
    await a.publish_many(keys.tasks, [_task(i) for i in range(3)])
    held = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=3, block_ms=100)
    ids = [d.entry_id for d in held[:2]]  # the third is never touched: as old as an untouched entry gets
    await asyncio.sleep(0.3)
    assert await b.touch(keys.tasks, K.GATEWAYS_GROUP, ids) == 0  # not b's: left as they are
    assert await b.reclaim(keys.tasks, K.GATEWAYS_GROUP, Task, min_idle_ms=250, count=1) != []  # b takes one
    assert await a.touch(keys.tasks, K.GATEWAYS_GROUP, ids) == 1  # a still holds the other: fresh again
    info = await a.redis.xpending_range(keys.tasks, K.GATEWAYS_GROUP, "-", "+", 10)
    # The idle times a reclaim goes by, read at one instant of the server's clock (however long
    # this loop stalls): touched after the 0.3 s wait, a's entry is younger than the untouched one
    # by at least that wait.
    idle = {as_text(i["message_id"]): i["time_since_delivered"] for i in info}
    assert idle[held[1].entry_id] + 250 <= idle[held[2].entry_id]
    assert sorted(i["consumer"] for i in info) == [b"worker-a", b"worker-a", b"worker-b"]
    assert {i["times_delivered"] for i in info if i["consumer"] == b"worker-a"} == {1}  # a touch is no delivery


async def test_requeue_hands_held_entries_back_for_any_consumer(clients):
    a, b, keys = clients
    await a.publish_many(keys.tasks, [_task(i) for i in range(2)])
    held = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=2, block_ms=100)
    n = await a.requeue(keys.tasks, K.GATEWAYS_GROUP, held, bump=lambda t: msgspec.structs.replace(t, attempt=7))
    assert n == 2 and (await a.redis.xpending(keys.tasks, K.GATEWAYS_GROUP))["pending"] == 0
    again = await b.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=100)
    assert sorted(d.msg.prompt_index for d in again) == [0, 1] and {d.msg.attempt for d in again} == {7}
    # entries no longer held by this consumer are not re-added twice
    assert await a.requeue(keys.tasks, K.GATEWAYS_GROUP, held) == 0


async def test_bad_entries_are_dead_lettered_acked_and_consumer_carries_on(clients):
    a, _, keys = clients
    await a.redis.xadd(keys.tasks, {K.ENTRY_FIELD: b"\xc1not msgpack"})
    await a.redis.xadd(keys.tasks, {b"other": b"x"})
    await a.redis.xadd(keys.tasks, {K.ENTRY_FIELD: encode(_task(1)).replace(b"\xa4task", b"\xa4tusk")})
    await a.publish(keys.tasks, _task(9))
    got = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=100)
    assert [d.msg.prompt_index for d in got] == [9]
    assert a.deadlettered == 3
    letters = [decode(f[K.ENTRY_FIELD], DeadLetter) for _, f in await a.redis.xrange(keys.deadletter)]
    reasons = [letter.reason for letter in letters]
    assert "undecodable" in reasons[0]
    assert "no 'm' field" in reasons[1]
    assert "expected a 'task' message" in reasons[2]
    assert letters[0].payload == b"\xc1not msgpack" and letters[0].source == keys.tasks
    pending = await a.redis.xpending(keys.tasks, K.GATEWAYS_GROUP)
    assert pending["pending"] == 1  # only the good one awaits its ack


async def test_registry_lists_live_workers_and_drops_removed(clients):
    a, _, keys = clients
    for wid, kind in [("gen-1", "generator"), ("gw-1", "gym_gateway")]:
        hb = Heartbeat(worker_id=wid, kind=kind, url="http://x", pid=1, host="h", state="ready", weight_version=3)
        await publish_heartbeat(a.redis, keys, hb)
    gens = await live_workers(a.redis, keys, "generator")
    assert [h.worker_id for h in gens] == ["gen-1"] and gens[0].weight_version == 3
    await remove_worker(a.redis, keys, "gen-1")
    assert [h.worker_id for h in await live_workers(a.redis, keys)] == ["gw-1"]


async def test_expired_heartbeats_drop_out(clients):
    a, _, keys = clients
    hb = Heartbeat(worker_id="old", kind="generator", url="u", pid=1, host="h", state="ready")
    await publish_heartbeat(a.redis, keys, hb)
    await a.redis.zadd(keys.registry, {"old": 1.0})  # expired long ago
    assert await live_workers(a.redis, keys) == []
    assert await a.redis.hget(keys.registry_info, "old") is None


async def test_read_latest_and_read_after_broadcast(clients):
    from shared.protocol import WeightAnnouncement

    a, b, keys = clients
    assert await a.read_latest(keys.weights, WeightAnnouncement) is None
    ids = [
        await a.publish(keys.weights, WeightAnnouncement(version=v, path=f"/w{v}", checksum="c", num_bytes=1))
        for v in range(3)
    ]
    latest = await b.read_latest(keys.weights, WeightAnnouncement)
    assert latest.msg.version == 2 and latest.entry_id == ids[2]
    after = await b.read_after(keys.weights, ids[0], WeightAnnouncement, block_ms=10)
    assert [d.msg.version for d in after] == [1, 2]


async def test_a_burst_beyond_the_pool_size_queues_instead_of_failing(redis_url):
    import asyncio

    client = connect(redis_url, max_connections=4)
    try:
        # 200 blocking commands at once on 4 connections: each waits for a free connection.
        results = await asyncio.gather(
            *[client.blpop([f"nothing-{uuid.uuid4().hex}"], timeout=0.05) for _ in range(200)]
        )
        assert results == [None] * 200
    finally:
        await client.aclose()


async def test_a_burst_of_sessions_reads_the_generator_registry_once(redis_url, monkeypatch):
    import asyncio

    from services.gym_gateway import pool as generator_pool

    redis = connect(redis_url)
    keys = K.RunKeys(f"pool-{uuid.uuid4().hex[:6]}")
    hb = Heartbeat(
        worker_id="gen-0", kind="generator", url="http://g", pid=1, host="h", state="ready", weight_version=3
    )
    await publish_heartbeat(redis, keys, hb)
    reads = 0

    async def counting_live_workers(*args, **kwargs):
        nonlocal reads
        reads += 1
        return await live_workers(*args, **kwargs)

    monkeypatch.setattr(generator_pool, "live_workers", counting_live_workers)
    pool = generator_pool.GeneratorPool(redis, keys, refresh_s=60.0)
    picks = await asyncio.gather(*[pool.pick() for _ in range(128)])
    assert picks == [("gen-0", "http://g", 3)] * 128 and reads == 1
    await redis.aclose()


async def _unacked_ids(redis, stream: str, all_ids: list[str], groups: list[str]) -> set[str]:
    """Entries some group still needs: pending there, or after its last-delivered id."""
    from shared.streams import _id_key

    needed: set[str] = set()
    info = {g["name"].decode(): g for g in await redis.xinfo_groups(stream)}
    for group in groups:
        pending = await redis.xpending_range(stream, group, "-", "+", 10_000)
        needed |= {p["message_id"].decode() for p in pending}
        last = _id_key(info[group]["last-delivered-id"].decode())
        needed |= {i for i in all_ids if _id_key(i) > last}
    return needed


@pytest.mark.parametrize("seed", range(4))
async def test_trimming_by_acknowledged_id_never_drops_an_unacked_entry(clients, seed):
    import random

    a, b, keys = clients
    rng = random.Random(seed)
    await a.ensure_group(keys.tasks, "audit")  # a second group that reads at its own pace
    ids: list[str] = []
    held: dict[str, list[str]] = {K.GATEWAYS_GROUP: [], "audit": []}
    for _ in range(40):
        ids += await a.publish_many(keys.tasks, [_task(i) for i in range(rng.randint(0, 4))])
        for group, client in ((K.GATEWAYS_GROUP, a), ("audit", b)):
            got = await client.read_group(keys.tasks, group, Task, count=rng.randint(1, 5), block_ms=None)
            held[group] += [d.entry_id for d in got]
            done = [i for i in held[group] if rng.random() < 0.5]
            await client.ack(keys.tasks, group, done)
            held[group] = [i for i in held[group] if i not in done]
        needed = await _unacked_ids(a.redis, keys.tasks, ids, list(held))
        await a.trim_acked(keys.tasks)
        left = [i.decode() for i, _ in await a.redis.xrange(keys.tasks)]
        assert needed <= set(left)  # nothing a group still needs is gone
        # and everything before the oldest needed entry is gone
        oldest = min(needed, key=ids.index) if needed else None
        assert left == (ids[ids.index(oldest) :] if oldest else [])
    # held entries can still be re-read with their payloads
    again = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=1000, pending=True)
    assert [d.entry_id for d in again] == held[K.GATEWAYS_GROUP]


async def test_trimming_keeps_recent_acknowledged_entries_and_skips_streams_without_groups(clients):
    a, _, keys = clients
    ids = await a.publish_many(keys.tasks, [_task(i) for i in range(3)])
    got = await a.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=3, block_ms=None)
    await a.ack(keys.tasks, K.GATEWAYS_GROUP, [d.entry_id for d in got])
    assert await a.trim_acked(keys.tasks, retention_s=3600) == 0  # acked, but younger than the retention
    assert await a.trim_acked(keys.tasks) == 3
    assert await a.redis.xlen(keys.tasks) == 0 and ids
    await a.publish(keys.weights, _task(0))  # a stream no group reads
    assert await a.trim_acked(keys.weights) == 0 and await a.redis.xlen(keys.weights) == 1
    assert await a.trim_acked(keys._k("no-such-stream")) == 0

"""A read-only snapshot of a run's queues and workers, straight from Redis.

    streams:  length of every stream of the run (XLEN)
    groups:   per consumer group: pending entries, lag (entries not yet delivered), and pending
              entries and idle time per consumer (XINFO GROUPS / XINFO CONSUMERS)
    workers:  every registered worker's last heartbeat and its age
    step:     the trainer's current step; pause reasons

Read by the trainer's ``/metrics`` (stream and pending gauges) and by ``streamrl status``. Nothing
here writes: expired registry members are shown as gone, not purged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import keys as K
from shared.pause import read_pauses
from shared.protocol import Heartbeat, ProtocolError, decode
from shared.redis_replies import as_bytes, scored_members

if TYPE_CHECKING:
    from shared.fleet_health import GeneratorHealth

STREAMS = ("tasks", "trajectories", "weights", "weight_acks", "deadletter")
GROUPS = (("tasks", K.GATEWAYS_GROUP), ("trajectories", K.TRAINER_GROUP))


@dataclass
class ConsumerStats:
    name: str
    pending: int
    idle_s: float


@dataclass
class GroupStats:
    stream: str
    group: str
    pending: int
    lag: int | None  # None when Redis cannot tell (entries deleted past the group's position)
    consumers: list[ConsumerStats] = field(default_factory=list)


@dataclass
class WorkerView:
    heartbeat: Heartbeat
    age_s: float  # time since the last heartbeat


@dataclass
class RunSnapshot:
    run_id: str
    streams: dict[str, int]
    groups: list[GroupStats]
    workers: list[WorkerView]
    step: int | None
    pause: dict[str, int]
    health: dict[str, GeneratorHealth] = field(default_factory=dict)  # by generator; filled by `streamrl status`


def _s(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


async def stream_lengths(redis: aioredis.Redis, keys: K.RunKeys) -> dict[str, int]:
    async with redis.pipeline(transaction=False) as pipe:
        for name in STREAMS:
            pipe.xlen(getattr(keys, name))
        lengths = await pipe.execute()
    return dict(zip(STREAMS, (int(n) for n in lengths), strict=True))


async def group_stats(redis: aioredis.Redis, keys: K.RunKeys) -> list[GroupStats]:
    """Pending entries per group and per consumer of the run's work queues (absent groups skipped)."""
    out: list[GroupStats] = []
    for name, group in GROUPS:
        stream = getattr(keys, name)
        try:
            infos = await redis.xinfo_groups(stream)
        except ResponseError:  # the stream does not exist yet
            continue
        for info in infos:
            if _s(info["name"]) != group:
                continue
            consumers = await redis.xinfo_consumers(stream, group)
            lag = info.get("lag")
            out.append(
                GroupStats(
                    stream=name,
                    group=group,
                    pending=int(info["pending"]),
                    lag=None if lag is None else int(lag),
                    consumers=[
                        ConsumerStats(_s(c["name"]), int(c["pending"]), int(c["idle"]) / 1000.0) for c in consumers
                    ],
                )
            )
    return out


async def worker_views(redis: aioredis.Redis, keys: K.RunKeys) -> list[WorkerView]:
    """Live workers with the age of their last heartbeat (the registry keeps their expiry time)."""
    now = time.time()
    members = scored_members(await redis.zrangebyscore(keys.registry, now, "+inf", withscores=True))
    if not members:
        return []
    raw = await redis.hmget(keys.registry_info, [m for m, _ in members])
    views = []
    for (_, expires_at), data in zip(members, raw, strict=True):
        if data is None:
            continue
        try:
            hb = decode(as_bytes(data), Heartbeat)
        except ProtocolError:
            continue
        views.append(WorkerView(hb, max(0.0, now - (expires_at - K.HEARTBEAT_TTL_S))))
    return sorted(views, key=lambda v: (v.heartbeat.kind, v.heartbeat.worker_id))


async def snapshot(redis: aioredis.Redis, run_id: str) -> RunSnapshot:
    keys = K.RunKeys(run_id)
    step = await redis.get(keys.trainer_step)
    return RunSnapshot(
        run_id=run_id,
        streams=await stream_lengths(redis, keys),
        groups=await group_stats(redis, keys),
        workers=await worker_views(redis, keys),
        step=None if step is None else int(step),
        pause=await read_pauses(redis, keys),
    )


async def find_runs(redis: aioredis.Redis) -> list[str]:
    """Run ids that have a worker registry or a task stream in this Redis."""
    runs: set[str] = set()
    every_run = K.RunKeys.pattern()
    for pattern in (every_run.registry, every_run.tasks):
        async for key in redis.scan_iter(match=pattern, count=1000):
            runs.add(K.run_id_of(_s(key)))
    return sorted(runs)

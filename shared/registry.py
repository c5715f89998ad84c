"""Worker registry: which generators, gateways and trainers are alive, and what they report.

Each worker refreshes its Heartbeat every HEARTBEAT_INTERVAL_S: the record goes to a hash and the
worker's expiry time to a sorted set. Readers purge expired members and read the rest, so a worker
that dies simply drops out after HEARTBEAT_TTL_S. The trainer uses this to know which generators
must confirm a refit; the CLI uses it to show what runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from shared import keys as K
from shared.protocol import Heartbeat, ProtocolError, decode, encode
from shared.redis_replies import as_bytes, members
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


async def publish_heartbeat(redis: aioredis.Redis, run_keys: K.RunKeys, hb: Heartbeat) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(run_keys.registry_info, hb.worker_id, encode(hb))
        pipe.zadd(run_keys.registry, {hb.worker_id: time.time() + K.HEARTBEAT_TTL_S})
        await pipe.execute()


async def remove_worker(redis: aioredis.Redis, run_keys: K.RunKeys, worker_id: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(run_keys.registry, worker_id)
        pipe.hdel(run_keys.registry_info, worker_id)
        await pipe.execute()


async def live_workers(redis: aioredis.Redis, run_keys: K.RunKeys, kind: str | None = None) -> list[Heartbeat]:
    """Heartbeats of live workers (optionally of one kind), sorted by worker id."""
    now = time.time()
    expired = await redis.zrangebyscore(run_keys.registry, "-inf", now)
    if expired:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(run_keys.registry, "-inf", now)
            pipe.hdel(run_keys.registry_info, *expired)
            await pipe.execute()
    ids = members(await redis.zrangebyscore(run_keys.registry, now, "+inf"))
    if not ids:
        return []
    raw = await redis.hmget(run_keys.registry_info, ids)
    out = []
    for wid, data in zip(ids, raw, strict=True):
        if data is None:
            continue
        try:
            hb = decode(as_bytes(data), Heartbeat)
        except ProtocolError as exc:
            log.error("unreadable registry record for %r: %s", wid, exc)
            continue
        if kind is None or hb.kind == kind:
            out.append(hb)
    return sorted(out, key=lambda h: h.worker_id)


class HeartbeatTask:
    """Publishes a worker's heartbeat in the background until closed.

    ``snapshot`` is called each interval and returns the current Heartbeat, so the record always
    reflects live state (weight version, in-flight count, ...).
    """

    def __init__(self, redis: aioredis.Redis, run_keys: K.RunKeys, snapshot: Callable[[], Heartbeat]) -> None:
        self._redis = redis
        self._keys = run_keys
        self._snapshot = snapshot
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    def beat_now(self) -> None:
        """Publish on the next loop turn instead of waiting for the interval."""
        self._wake.set()

    async def _run(self) -> None:
        while not self._closing:
            try:
                await publish_heartbeat(self._redis, self._keys, self._snapshot())
            except Exception as exc:  # Redis briefly away: keep trying, the TTL covers the gap
                log.warning("heartbeat failed: %s", exc)
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
            # arrives in the same loop turn as a beat_now() wake-up, and aclose() then hangs.
            try:
                async with asyncio.timeout(K.HEARTBEAT_INTERVAL_S):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def aclose(self, worker_id: str) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            if await cancel_and_wait([self._task], timeout_s=3 * K.HEARTBEAT_INTERVAL_S, grace_s=0.0):
                log.warning("heartbeat task of %s did not stop", worker_id)
            elif not self._task.cancelled() and self._task.exception() is not None:
                log.warning("heartbeat task of %s ended with %r", worker_id, self._task.exception())
        try:
            await remove_worker(self._redis, self._keys, worker_id)
        except Exception as exc:
            log.warning("could not deregister %s: %s", worker_id, exc)


def default_worker_id(kind: str) -> str:
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"

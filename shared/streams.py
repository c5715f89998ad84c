"""Redis Streams client: produce, consume with consumer groups, ack, reclaim, dead-letter.

Delivery contract (docs/fault_tolerance.md): a consumer acks an entry only once its effect is durable.
Entries a dead consumer left pending are taken over with XAUTOCLAIM after an idle timeout.
An entry that cannot be decoded or validated (malformed, truncated, another schema version, or
larger than its stream's ``keys.MAX_ENTRY_BYTES``) is copied to the dead-letter stream with the
reason and acked, so one bad writer cannot wedge a consumer group and nothing disappears silently;
readers of the broadcast streams (no group) dead-letter what they skip too. Every client counts
its dead letters per stream (``deadlettered_by_stream``, served as a metric).

Work-queue streams are trimmed by acknowledged id (`StreamClient.trim_acked`): entries before the
oldest one still pending or not yet delivered in any consumer group go, never an unacked one.

Callers: the trainer (tasks out, trajectories in, weights out, weight acks in), the gateway
(tasks in, trajectories out), the generator (weights in, weight acks out).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry  # the asyncio one: redis.retry.Retry never retries a coroutine
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys as K
from shared.protocol import DeadLetter, Message, ProtocolError, decode, encode
from shared.redis_replies import StreamEntry, as_text, range_entries, read_entries

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
P = TypeVar("P")
T = TypeVar("T")


# Backoff sleeps 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s, then 2 s per retry: 20 retries span about 33 s.
REDIS_RECONNECT_BUDGET_S = 33.0
_RECONNECT_RETRIES = 20


class _Retry(Retry):
    """Retries connection errors and timeouts, but not a refused login (a subclass of
    ConnectionError): no retry fixes a wrong password, and it should be reported at once."""

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[[Exception], Any] | Callable[[Exception, int], Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(exc: Exception) -> bool:
            if isinstance(exc, (AuthenticationError, AuthorizationError)):
                return False
            return is_retryable is None or is_retryable(exc)

        return await super().call_with_retry(do, fail, is_retryable=retryable, with_failure_count=with_failure_count)


def connect(
    url: str, *, socket_timeout_s: float = 30.0, max_connections: int = 256, ride_out_restarts: bool = True
) -> aioredis.Redis:
    """An asyncio Redis client that retries transient connection errors with backoff.

    A command that meets a refused or dropped connection, or a socket timeout, is sent again on a
    fresh connection with exponential backoff (0.1 s doubling to 2 s) for about
    REDIS_RECONNECT_BUDGET_S of backoff, plus up to the socket timeout per attempt when Redis
    accepts connections but does not answer. A Redis restart or failover within that time is
    ridden out; past it the error reaches the caller (the trainer fails the run loudly).

    Works with redis://, rediss:// (TLS) and unix:// URLs, with passwords and ACL users in the URL.
    The pool blocks (up to the socket timeout) when all ``max_connections`` are busy instead of
    failing the command: a burst of hundreds of rollouts opening sessions at once must queue, not
    error. A command line tool that only reads (``ride_out_restarts=False``) tries twice and
    reports a wrong or dead URL at once instead.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=socket_timeout_s,
        decode_responses=False,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=5.0,
        health_check_interval=15,
        retry=_Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=_RECONNECT_RETRIES if ride_out_restarts else 1),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


@dataclass(frozen=True)
class Delivery(Generic[P]):
    """One decoded entry read through a consumer group."""

    entry_id: str
    msg: P


# KEYS[1] input stream, KEYS[2] output stream; ARGV: group, entry id, consumer, field, payload.
_PUBLISH_IF_OWNED = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #p == 0 then return false end
local id = redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return id
"""
# KEYS[1] stream; ARGV: group, entry id, consumer, field, payload.
_REQUEUE_IF_OWNED = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #p == 0 then return false end
local id = redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return id
"""

# KEYS[1] stream; ARGV: group, entry id, consumer. XCLAIM ... JUSTID to the owner itself resets the
# entry's idle time without counting a delivery.
_TOUCH_IF_OWNED = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #p == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_key(entry_id)
    return f"{ms}-{seq + 1}"


class StreamClient:
    """Typed access to the run's streams for one consumer."""

    def __init__(self, redis: aioredis.Redis, run_keys: K.RunKeys, consumer: str) -> None:
        self.redis = redis
        self.keys = run_keys
        self.consumer = consumer
        self.deadlettered = 0
        self.deadlettered_by_stream: dict[str, int] = {}  # stream name (keys.stream_name) -> count

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create ``group`` on ``stream`` (and the stream) unless it exists."""
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def publish(self, stream: str, msg: Message, *, maxlen: int | None = None) -> str:
        entry_id = await self.redis.xadd(
            stream, {K.ENTRY_FIELD: encode(msg)}, maxlen=maxlen, approximate=maxlen is not None
        )
        return as_text(entry_id)

    async def publish_many(self, stream: str, msgs: Sequence[Message]) -> list[str]:
        """Publish in one pipelined round trip (not a transaction: each XADD is atomic itself)."""
        if not msgs:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for msg in msgs:
                pipe.xadd(stream, {K.ENTRY_FIELD: encode(msg)})
            ids = await pipe.execute()
        return [as_text(i) for i in ids]

    async def read_group(
        self,
        stream: str,
        group: str,
        expected: type[M],
        *,
        count: int,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[Delivery[M]]:
        """Read up to ``count`` entries for this consumer.

        ``pending=True`` re-reads this consumer's own unacknowledged entries (after a restart);
        otherwise new entries are read, blocking up to ``block_ms``.
        """
        reply = await self.redis.xreadgroup(
            group, self.consumer, {stream: "0" if pending else ">"}, count=count, block=None if pending else block_ms
        )
        return await self._decode_entries(stream, group, read_entries(reply), expected)

    async def reclaim(
        self, stream: str, group: str, expected: type[M], *, min_idle_ms: int, count: int = 100
    ) -> list[Delivery[M]]:
        """Take over entries other consumers left pending for at least ``min_idle_ms``."""
        claimed: list[StreamEntry] = []
        start = "0-0"
        while True:
            reply = await self.redis.xautoclaim(stream, group, self.consumer, min_idle_ms, start_id=start, count=count)
            start, entries = as_text(reply[0]), reply[1]
            deleted = reply[2] if len(reply) > 2 else []
            if deleted:
                # Entries deleted from the stream while pending (trimmed): nothing to redeliver.
                log.warning("reclaim on %s: %d pending entries no longer exist", stream, len(deleted))
            claimed.extend(entries)
            if start == "0-0" or len(claimed) >= count:
                break
        if claimed:
            log.info("reclaimed %d idle entries on %s for %s", len(claimed), stream, self.consumer)
        return await self._decode_entries(stream, group, claimed, expected)

    async def ack(self, stream: str, group: str, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        return await self.redis.xack(stream, group, *entry_ids)

    async def publish_and_ack(
        self, out_stream: str, msg: Message, in_stream: str, group: str, entry_id: str
    ) -> str | None:
        """Publish ``msg`` and ack ``entry_id`` in one atomic step, only while this consumer still
        owns the pending entry. None (nothing published) when the entry was acked or taken over by
        another consumer meanwhile, so a result is published at most once per entry."""
        res = await self.redis.eval(
            _PUBLISH_IF_OWNED, 2, in_stream, out_stream, group, entry_id, self.consumer, K.ENTRY_FIELD, encode(msg)
        )
        return as_text(res) if res else None

    async def requeue(
        self,
        stream: str,
        group: str,
        deliveries: Sequence[Delivery[M]],
        bump: Callable[[M], Message] | None = None,
    ) -> int:
        """Hand entries this consumer holds back to the group at once (a drain that cannot finish
        them): each is re-added as a new entry (``bump(msg)`` may update it first) and the old one
        acked, atomically, so another consumer reads it without waiting for a reclaim."""
        n = 0
        for d in deliveries:
            msg = bump(d.msg) if bump else d.msg
            if await self.redis.eval(
                _REQUEUE_IF_OWNED, 1, stream, group, d.entry_id, self.consumer, K.ENTRY_FIELD, encode(msg)
            ):
                n += 1
        if n:
            log.info("released %d entries of %s back to %s", n, stream, group)
        return n

    async def touch(self, stream: str, group: str, entry_ids: Sequence[str]) -> int:
        """Reset the idle time of the entries this consumer still holds pending, each checked and
        touched atomically: a live holder of an entry that may wait long (an external task waiting
        for an agent) keeps it from being reclaimed as abandoned. The number still held."""
        n = 0
        for entry_id in entry_ids:
            n += int(await self.redis.eval(_TOUCH_IF_OWNED, 1, stream, group, entry_id, self.consumer))
        return n

    async def trim_acked(self, stream: str, *, retention_s: float = 0.0) -> int:
        """Delete the entries of ``stream`` that every consumer group has acknowledged, except those
        younger than ``retention_s`` (by the Redis server's clock); the number deleted.

        The cut is the oldest entry still pending or not yet delivered in any group (XINFO GROUPS
        last-delivered-id, XPENDING's smallest id), and XTRIM MINID deletes only entries before
        it: an unacknowledged entry is never dropped. Entries acked or delivered meanwhile only
        move the true cut later, so the race with consumers is harmless. A stream without groups
        is left alone."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # the stream does not exist (yet)
            return 0
        if not groups:
            return 0
        bounds: list[str] = []  # per group, then the retention bound: the cut is the smallest
        for g in groups:
            bound = _next_id(as_text(g["last-delivered-id"]))
            if g["pending"]:
                summary = await self.redis.xpending(stream, g["name"])
                if summary["pending"]:
                    bound = min(bound, as_text(summary["min"]), key=_id_key)
            bounds.append(bound)
        if retention_s > 0:
            sec, usec = await self.redis.time()
            bounds.append(f"{max(0, sec * 1000 + usec // 1000 - int(retention_s * 1000))}-0")
        cut = min(bounds, key=_id_key)
        return int(await self.redis.xtrim(stream, minid=cut, approximate=False))

    async def dead_letter(self, source: str, entry_id: str, payload: bytes, reason: str) -> None:
        self.deadlettered += 1
        name = K.stream_name(source)
        self.deadlettered_by_stream[name] = self.deadlettered_by_stream.get(name, 0) + 1
        log.warning("dead-lettering %s entry %s: %s", source, entry_id, reason)
        letter = DeadLetter(
            source=source, entry_id=entry_id, reason=reason, payload=payload[: K.DEADLETTER_PAYLOAD_MAX_BYTES]
        )
        await self.publish(self.keys.deadletter, letter, maxlen=K.DEADLETTER_MAXLEN)

    async def read_latest(self, stream: str, expected: type[M]) -> Delivery[M] | None:
        """The newest entry of a broadcast stream (e.g. the latest weight announcement). An
        unusable one is dead-lettered and raises ProtocolError."""
        reply = range_entries(await self.redis.xrevrange(stream, count=1))
        if not reply:
            return None
        eid = as_text(reply[0][0])
        return Delivery(eid, await self._decode_or_dead_letter(stream, eid, reply[0][1], expected))

    async def read_after(
        self, stream: str, last_id: str, expected: type[M], *, block_ms: int, count: int = 100
    ) -> list[Delivery[M | None]]:
        """Read a broadcast stream (no consumer group) after ``last_id``. A bad entry is
        dead-lettered (by every reader that meets it) and comes back as a Delivery whose ``msg``
        is None, so the caller's cursor still moves past it."""
        reply = await self.redis.xread({stream: last_id}, count=count, block=block_ms)
        out: list[Delivery[M | None]] = []
        for entry_id, fields in read_entries(reply):
            eid = as_text(entry_id)
            try:
                out.append(Delivery(eid, await self._decode_or_dead_letter(stream, eid, fields, expected)))
            except ProtocolError:
                out.append(Delivery(eid, None))
        return out

    async def _decode_or_dead_letter(
        self, stream: str, entry_id: str, fields: dict[bytes, bytes] | None, expected: type[M]
    ) -> M:
        """Decode one entry; an unusable one is dead-lettered with the reason, then ProtocolError."""
        payload = fields.get(K.ENTRY_FIELD) if fields else None
        limit = K.max_entry_bytes(stream)
        if payload is None:
            reason = f"entry has no {K.ENTRY_FIELD.decode()!r} field"
        elif len(payload) > limit:
            reason = (
                f"entry of {len(payload)} bytes exceeds the {limit}-byte limit of stream "
                f"{K.stream_name(stream)!r} (keys.MAX_ENTRY_BYTES); payload cut to "
                f"{K.DEADLETTER_PAYLOAD_MAX_BYTES} bytes"
            )
        else:
            try:
                return decode(payload, expected)
            except ProtocolError as exc:
                reason = str(exc)
        await self.dead_letter(stream, entry_id, payload or b"", reason)
        raise ProtocolError(reason)

    async def _decode_entries(
        self, stream: str, group: str, entries: list[StreamEntry], expected: type[M]
    ) -> list[Delivery[M]]:
        good: list[Delivery[M]] = []
        bad: list[str] = []
        for entry_id, fields in entries:
            eid = as_text(entry_id)
            try:
                good.append(Delivery(eid, await self._decode_or_dead_letter(stream, eid, fields, expected)))
            except ProtocolError:
                bad.append(eid)
        if bad:
            await self.ack(stream, group, bad)
        return good

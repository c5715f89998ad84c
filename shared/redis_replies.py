"""Typed views of the Redis replies this project reads.

redis-py types each reply for every client configuration at once: strings as ``bytes | str`` (it
cannot know ``decode_responses``) and stream reads as the union of their RESP2 and RESP3 shapes.
Every client here is made with ``decode_responses=False`` over RESP2 (`shared.streams.connect`, and
the synchronous clients of the CLI's scale channel), so strings come back as bytes and stream reads
as lists. These helpers say so once, where a reply enters the code; they change no value.

Callers: shared.streams, shared.registry, shared.queue_stats, the trainer's refit, the generator's
weight watcher and the CLI's scale channel and benchmarks.
"""

from __future__ import annotations

from typing import Any, cast

from redis.typing import StreamRangeResponse, XReadGroupResponse, XReadResponse, ZSetRangeResponse

# One stream entry as a RESP2 client without decode_responses returns it: (entry id, fields). Read
# through a consumer group the fields are None for an entry deleted while pending; XRANGE and
# XREVRANGE return only entries that exist.
StreamEntry = tuple[bytes, dict[bytes, bytes] | None]
RangeEntry = tuple[bytes, dict[bytes, bytes]]


def as_bytes(raw: bytes | str) -> bytes:
    """A string reply (GET, HGET, a list or set member): bytes, as decode_responses=False returns it."""
    return cast(bytes, raw)


def as_text(raw: bytes | str) -> str:
    """A string reply (an entry id, a key, a consumer name) as text."""
    return raw.decode() if isinstance(raw, bytes) else raw


def read_entries(reply: XReadResponse | XReadGroupResponse | None) -> list[StreamEntry]:
    """The entries of the single stream an XREAD or XREADGROUP asked for; [] when it timed out.

    RESP2 shape: ``[[stream, [(id, fields), ...]]]``, or None/empty when nothing arrived."""
    return cast(list[StreamEntry], cast(list[list[Any]], reply)[0][1]) if reply else []


def range_entries(reply: StreamRangeResponse | None) -> list[RangeEntry]:
    """The entries of an XRANGE or XREVRANGE reply (``[(id, fields), ...]``); [] for none."""
    return cast(list[RangeEntry], reply) if reply else []


def members(reply: ZSetRangeResponse) -> list[bytes]:
    """The members of a sorted-set range read without scores (ZRANGEBYSCORE)."""
    return cast(list[bytes], reply)


def scored_members(reply: ZSetRangeResponse) -> list[tuple[bytes, float]]:
    """The (member, score) pairs of a sorted-set range read ``withscores=True``."""
    return cast(list[tuple[bytes, float]], reply)

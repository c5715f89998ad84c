"""Shared set-up of the refit tests against a real Valkey: a trainer-side `WeightPublisher` on a
fresh run, a stand-in weights writer, and a generator's registry heartbeat as the test plays it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from services.trainer.refit import WeightPublisher
from services.trainer.weight_transport import FilesystemTransport
from shared import keys as K
from shared.pause import PauseControl
from shared.protocol import Heartbeat
from shared.registry import publish_heartbeat
from shared.streams import StreamClient, connect


def save_dummy(path: Path) -> None | dict[str, str]:
    """A weights writer for the publisher: one small safetensors-named file."""
    (path / "model.safetensors").write_bytes(b"\x00" * 64)


@asynccontextmanager
async def publisher_for(
    redis_url: str, tmp_path: Path, run_prefix: str, timeout_s: float
) -> AsyncIterator[tuple[WeightPublisher, StreamClient]]:
    """(publisher, the trainer's stream client) on a run of its own; the connection closed after."""
    redis = connect(redis_url)
    keys = K.RunKeys(f"{run_prefix}-{uuid.uuid4().hex[:6]}")
    streams = StreamClient(redis, keys, "trainer")
    transport = FilesystemTransport(tmp_path / "weights", save_dummy)
    pub = WeightPublisher(streams, PauseControl(redis, keys), transport, timeout_s=timeout_s, in_flight_updates=False)
    try:
        yield pub, streams
    finally:
        await redis.aclose()


async def beat(streams: StreamClient, worker_id: str, state: str = "ready") -> None:
    """One registry heartbeat of generator ``worker_id``, as a generator sends it."""
    hb = Heartbeat(worker_id=worker_id, kind="generator", url="http://x", pid=1, host="h", state=state)
    await publish_heartbeat(streams.redis, streams.keys, hb)

"""Shared set-up of the refit tests against a real Valkey (tests/integration/test_refit.py,
test_refit_membership.py, test_stream_bad_entries.py, tests/faults/test_refit_redis_pause.py): a
trainer-side `WeightPublisher` on a fresh run, a stand-in weights writer, and the generators the
tests play (`tests.support.peers.FakeGenerator`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from services.trainer.refit import WeightPublisher
from services.trainer.weight_transport import FilesystemTransport
from shared import keys as K
from shared.pause import PauseControl
from shared.streams import StreamClient, connect
from tests.support.peers import FakeGenerator


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


def played(streams: StreamClient, worker_id: str) -> FakeGenerator:
    """Generator ``worker_id`` as a refit test plays it on the trainer's ``streams``."""
    return FakeGenerator(streams, worker_id, url="http://x")

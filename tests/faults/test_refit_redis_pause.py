"""A refit rides out a Redis that stops answering for longer than the heartbeat TTL.

While Redis is frozen (SIGSTOP) no heartbeat lands, so when it answers again every worker's
registry entry looks expired until its next heartbeat, up to one interval later. A refit that
read the registry in that window used to drop every generator that had not confirmed yet and
fail with "every generator left before confirming". The generator here is played by the test as
in tests/integration/test_refit_membership.py (the real heartbeat task, and a WeightAck sent
a while after the announcement, as a generator draining its requests and loading would), against
a real Valkey the test freezes.

Off by default (a long variant, STREAMRL_LONG_TESTS=1): it passes alone but has failed inside the
full suite on a loaded 2-core machine, for a reason not yet found; the default chaos run
(tests/faults/test_chaos_run.py) freezes Redis past the heartbeat TTL in the middle of a refit
and checks that no live generator is dropped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

from services.trainer.refit import WeightPublisher
from services.trainer.weight_transport import FilesystemTransport
from shared import keys as K
from shared.pause import PauseControl
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from shared.streams import StreamClient, connect
from tests.support.peers import FakeGenerator
from tests.support.redis import start_valkey
from tests.support.refit import save_dummy
from tests.support.runs import long_variant

pytestmark = [pytest.mark.integration, pytest.mark.faults]

LOAD_S = 1.5  # announcement seen -> ack, longer than the publisher's blocking read of the acks


@long_variant
async def test_a_refit_does_not_drop_generators_that_were_silent_only_because_redis_was(tmp_path):
    server = start_valkey(tmp_path / "valkey")
    redis = connect(server.url)
    keys = K.RunKeys("refit-pause")
    trainer = StreamClient(redis, keys, "trainer")
    generator = StreamClient(redis, keys, "gen-0")
    hb = Heartbeat(
        worker_id="gen-0",
        kind="generator",
        url="http://x",
        pid=os.getpid(),
        host=socket.gethostname(),
        state="ready",
        weight_version=0,
    )
    heartbeat = HeartbeatTask(redis, keys, lambda: hb)
    heartbeat.start()
    transport = FilesystemTransport(tmp_path / "weights", save_dummy)
    pub = WeightPublisher(trainer, PauseControl(redis, keys), transport, timeout_s=60.0, in_flight_updates=False)
    try:
        await asyncio.sleep(1.5)  # registered
        player = asyncio.create_task(FakeGenerator(generator, "gen-0").answer(1, load_s=LOAD_S, poll_s=0.05))
        refit = asyncio.create_task(pub.refit(1))
        while b"refit" not in await redis.hkeys(keys.pause):  # the refit has begun
            await asyncio.sleep(0.005)
        os.kill(server.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        await asyncio.sleep(K.HEARTBEAT_TTL_S + 2)  # the loop keeps running: the heartbeat task is blocked
        os.kill(server.proc.pid, signal.SIGCONT)
        report = await asyncio.wait_for(refit, 30)
        await player
        assert time.monotonic() - t0 > K.HEARTBEAT_TTL_S
        assert report.generators == ["gen-0"] and report.dropped == []
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await heartbeat.aclose("gen-0")
        await redis.aclose()
        server.stop()

"""A refit rides out a Redis that stops answering for longer than the heartbeat TTL.

While Redis is frozen (SIGSTOP) no heartbeat lands, so when it answers again every worker's
registry entry looks expired until its next heartbeat, up to one interval later. A refit that
read the registry in that window used to drop every generator that had not confirmed yet and
fail with "every generator left before confirming". The generator here is played by the test as
in tests/integration/test_refit_membership.py (the real heartbeat task, and a WeightAck sent
a while after the announcement, as a generator draining its requests and loading would), against
a real Valkey the test freezes.

The refit notes a stall when one of its Redis calls takes far longer than asked, and for a
heartbeat TTL after it an absence from the registry proves nothing. It used to time only its
registry and ack reads: a freeze that landed on the announcement (or the ack cursor) went
unnoticed, and on a loaded machine, where the first heartbeat after the freeze lands late, the
refit dropped the generator. Every Redis call of the refit is timed now; the second test puts the
freeze on the announcement and holds the heartbeat back, which failed every time before.
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
from shared.registry import HeartbeatTask, publish_heartbeat
from shared.streams import StreamClient, connect
from tests.support.peers import FakeGenerator
from tests.support.redis import start_valkey
from tests.support.refit import save_dummy

pytestmark = [pytest.mark.integration, pytest.mark.faults]

LOAD_S = 1.5  # announcement seen -> ack, longer than the publisher's blocking read of the acks
LATE_S = 2.0  # the first heartbeat after the freeze lands this late (a loaded machine)


def _heartbeat() -> Heartbeat:
    return Heartbeat(
        worker_id="gen-0",
        kind="generator",
        url="http://x",
        pid=os.getpid(),
        host=socket.gethostname(),
        state="ready",
        weight_version=0,
    )


async def test_a_refit_does_not_drop_generators_that_were_silent_only_because_redis_was(tmp_path):
    server = start_valkey(tmp_path / "valkey")
    redis = connect(server.url)
    keys = K.RunKeys("refit-pause")
    trainer = StreamClient(redis, keys, "trainer")
    generator = StreamClient(redis, keys, "gen-0")
    hb = _heartbeat()
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


async def test_a_freeze_on_the_announcement_and_a_late_heartbeat_do_not_drop_the_generator(tmp_path):
    """Redis freezes (past the heartbeat TTL) just as the refit publishes its announcement, and
    the generator's first heartbeat after it lands LATE_S after Redis answers again: the refit
    has seen the stall on the announcement, waits, and the generator confirms."""
    server = start_valkey(tmp_path / "valkey")
    redis = connect(server.url)
    keys = K.RunKeys("refit-announce-pause")
    trainer = StreamClient(redis, keys, "trainer")
    generator = StreamClient(redis, keys, "gen-0")
    transport = FilesystemTransport(tmp_path / "weights", save_dummy)
    pub = WeightPublisher(trainer, PauseControl(redis, keys), transport, timeout_s=60.0, in_flight_updates=False)
    loop = asyncio.get_running_loop()
    late: list[asyncio.Task[None]] = []

    async def beat_late() -> None:
        await asyncio.sleep(LATE_S)
        await publish_heartbeat(redis, keys, _heartbeat())

    def thaw() -> None:
        os.kill(server.proc.pid, signal.SIGCONT)
        late.append(asyncio.create_task(beat_late()))

    publish = trainer.publish

    async def freezing_publish(stream, msg, **kw):
        if stream == keys.weights and not late and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGSTOP)
            loop.call_later(K.HEARTBEAT_TTL_S + 2, thaw)
        return await publish(stream, msg, **kw)

    trainer.publish = freezing_publish  # type: ignore[method-assign]
    try:
        await publish_heartbeat(redis, keys, _heartbeat())  # registered, its entry expires in the freeze
        player = asyncio.create_task(FakeGenerator(generator, "gen-0").answer(1, load_s=LOAD_S, poll_s=0.05))
        report = await asyncio.wait_for(pub.refit(1), 60)
        await player
        assert late, "the announcement was never frozen"
        assert report.generators == ["gen-0"] and report.dropped == []
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await asyncio.gather(*late, return_exceptions=True)
        await redis.aclose()
        server.stop()

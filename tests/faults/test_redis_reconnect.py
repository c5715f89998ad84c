"""The services' Redis client (`shared.streams.connect`) rides out a Redis restart: a command sent
while the server is down completes once it is back, and a stream consumer group survives the
restart on the append-only file. Past REDIS_RECONNECT_BUDGET_S of backoff the error reaches the
caller (long variant: it takes that long). A refused login is not retried: it is reported at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import keys as K
from shared.protocol import Task
from shared.streams import REDIS_RECONNECT_BUDGET_S, StreamClient, connect
from tests.support.messages import make_task
from tests.support.ports import refused_port
from tests.support.redis import start_valkey
from tests.support.runs import long_variant

pytestmark = [pytest.mark.integration, pytest.mark.faults]


def _task(i: int) -> Task:
    return make_task(f"g{i}", prompt_index=i)


async def test_a_command_sent_while_redis_is_down_completes_after_the_restart(tmp_path):
    server = start_valkey(tmp_path / "valkey", appendonly=True, appendfsync="always")
    redis = connect(server.url)
    streams = StreamClient(redis, K.RunKeys("reconnect"), "gateway-0")
    try:
        await streams.ensure_group(streams.keys.tasks, K.GATEWAYS_GROUP)
        first = await streams.publish(streams.keys.tasks, _task(0))
        got = await streams.read_group(streams.keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=100)
        assert [d.entry_id for d in got] == [first]
        server.proc.kill()  # kill -9: nothing is flushed at exit
        server.proc.wait()
        t0 = time.monotonic()
        publish = asyncio.create_task(streams.publish(streams.keys.tasks, _task(1)))
        await asyncio.sleep(2.0)
        assert not publish.done()  # waiting and retrying, not failed
        server.start()
        second = await asyncio.wait_for(publish, 30)  # backoff capped at 2 s, inside the reconnect budget
        assert time.monotonic() - t0 >= 2.0
        # The group and its pending entry came back from the append-only file.
        pending = await streams.read_group(streams.keys.tasks, K.GATEWAYS_GROUP, Task, count=10, pending=True)
        assert [d.entry_id for d in pending] == [first]
        fresh = await streams.read_group(streams.keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=100)
        assert [d.entry_id for d in fresh] == [second]
    finally:
        await redis.aclose()
        server.stop()


@long_variant
async def test_past_the_budget_the_error_reaches_the_caller():
    with refused_port() as port:
        redis = connect(f"redis://127.0.0.1:{port}/0")  # nothing listens there
        t0 = time.monotonic()
        try:
            with pytest.raises(RedisConnectionError):
                await redis.ping()
        finally:
            await redis.aclose()
    # The requirement: the error arrives once REDIS_RECONNECT_BUDGET_S of backoff is spent, not much
    # sooner, and not much later (the upper margin is for a loaded machine).
    assert REDIS_RECONNECT_BUDGET_S - 3 < time.monotonic() - t0 < REDIS_RECONNECT_BUDGET_S + 30


async def test_a_wrong_password_is_reported_at_once(tmp_path):
    server = start_valkey(tmp_path / "valkey", extra_args=["--requirepass", "right-password"])
    redis = connect(f"redis://:wrong-password@127.0.0.1:{server.port}/0")
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            await redis.ping()
    finally:
        await redis.aclose()
        server.stop()
    # The requirement: reported at once, not retried: well under the REDIS_RECONNECT_BUDGET_S (33 s)
    # a retried error takes to come through.
    assert time.monotonic() - t0 < REDIS_RECONNECT_BUDGET_S / 2

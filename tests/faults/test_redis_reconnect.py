"""The services' Redis client (`shared.streams.connect`) rides out a Redis restart: a command sent
while the server is down completes once it is back, and a stream consumer group survives the
restart on the append-only file. Past REDIS_RECONNECT_BUDGET_S of backoff the error reaches the
caller (long variant: it takes that long). A refused login is not retried: it is reported at once.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import keys as K
from shared.protocol import SamplingParams, Task
from shared.streams import REDIS_RECONNECT_BUDGET_S, StreamClient, connect
from streamrl.redis_server import RedisServer
from tests.faults.harness import long_variant
from tests.ports import refused_port

pytestmark = [pytest.mark.integration, pytest.mark.faults]


def _task(i: int) -> Task:
    return Task(
        task_id=f"g{i}/0",
        group_id=f"g{i}",
        index_in_group=0,
        group_size=1,
        prompt_index=i,
        env="echo",
        instance={},
        kind="train",
        target_step=0,
        sampling=SamplingParams(),
        deadline_s=60.0,
    )


async def test_a_command_sent_while_redis_is_down_completes_after_the_restart(tmp_path):
    server = RedisServer(
        tmp_path / "valkey", appendonly=True, appendfsync="always", binary=os.environ.get("STREAMRL_TEST_REDIS_BIN")
    )
    server.start()
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
        second = await asyncio.wait_for(publish, 15)
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
    assert REDIS_RECONNECT_BUDGET_S - 3 < time.monotonic() - t0 < REDIS_RECONNECT_BUDGET_S + 10


async def test_a_wrong_password_is_reported_at_once(tmp_path):
    server = RedisServer(
        tmp_path / "valkey",
        binary=os.environ.get("STREAMRL_TEST_REDIS_BIN"),
        extra_args=["--requirepass", "right-password"],
    )
    server.start()
    redis = connect(f"redis://:wrong-password@127.0.0.1:{server.port}/0")
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            await redis.ping()
    finally:
        await redis.aclose()
        server.stop()
    assert time.monotonic() - t0 < 5.0

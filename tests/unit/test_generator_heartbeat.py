"""The heartbeat the generator registers with stops when cancelled, even when a wake-up
(``beat_now``, e.g. at SIGTERM) lands in the same loop turn as the cancellation. On Python 3.11,
``asyncio.wait_for`` swallows such a cancellation, which left shutdown waiting on the heartbeat
task and the worker registered."""

import asyncio

import pytest

import shared.registry as registry
from shared.keys import RunKeys
from shared.protocol import Heartbeat

pytestmark = pytest.mark.unit


async def test_cancel_right_after_beat_now_stops_the_task(monkeypatch):
    beats = []

    async def publish(redis, keys, hb):
        beats.append(hb)

    monkeypatch.setattr(registry, "publish_heartbeat", publish)
    hb = Heartbeat(worker_id="g", kind="generator", url="http://x", pid=1, host="h", state="ready")
    task = registry.HeartbeatTask(None, RunKeys("t"), lambda: hb)
    task.start()
    await asyncio.sleep(0.05)  # first beat published, now waiting for the interval or a wake-up
    assert len(beats) == 1
    task.beat_now()
    task._task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task._task), 30.0)


async def test_aclose_stops_even_when_the_redis_client_swallows_the_cancel(monkeypatch):
    # redis-py 8.1 pipelines lose a cancellation that lands while they hand the connection back
    # (measured: about 1 in 3 cancels of a tight pipeline loop); aclose must not depend on it.
    started = asyncio.Event()
    removed = []

    async def publish(redis, keys, hb):
        started.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass  # what the client library does in the bad case

    async def remove(redis, keys, worker_id):
        removed.append(worker_id)

    monkeypatch.setattr(registry, "publish_heartbeat", publish)
    monkeypatch.setattr(registry, "remove_worker", remove)
    hb = Heartbeat(worker_id="g", kind="generator", url="http://x", pid=1, host="h", state="ready")
    task = registry.HeartbeatTask(None, RunKeys("t"), lambda: hb)
    task.start()
    await started.wait()
    closing = asyncio.create_task(task.aclose("g"))
    done, _ = await asyncio.wait({closing}, timeout=30.0)
    assert closing in done, "aclose hung on a lost cancellation"
    assert task._task.done() and removed == ["g"]

"""Stopping tasks for certain (`shared.tasks`): a cancel that a task drops is repeated, cleanup
gets its grace period, a task that never stops is reported, and a shutdown step is bounded."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from shared.streams import connect
from shared.tasks import bounded, cancel_and_wait


async def _drops_cancels(state: dict[str, int]) -> None:
    """A loop that carries on after its first ``state["drop"]`` cancels, as a task does whose
    cancel landed in redis-py's write; counts them in ``state["cancels"]``."""
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            state["cancels"] += 1
            if state["cancels"] > state["drop"]:
                raise


async def test_a_dropped_cancel_is_repeated_until_the_task_ends() -> None:
    state = {"cancels": 0, "drop": 2}
    task = asyncio.create_task(_drops_cancels(state))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # one cancel did not stop it
    assert await cancel_and_wait([task], timeout_s=5.0, grace_s=0.1) == set()
    assert task.cancelled() and state["cancels"] == 3


async def test_cleanup_runs_undisturbed_within_the_grace_period() -> None:
    cleaned = asyncio.Event()

    async def with_cleanup() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.3)  # e.g. ending a pause in Redis
            cleaned.set()

    task = asyncio.create_task(with_cleanup())
    await asyncio.sleep(0.01)
    # A grace period far longer than the cleanup: only a cancel during it could disturb the cleanup.
    assert await cancel_and_wait([task], timeout_s=60.0, grace_s=30.0) == set()
    assert cleaned.is_set() and task.cancelled()


async def test_a_task_that_never_stops_is_returned_at_the_deadline() -> None:
    state = {"cancels": 0, "drop": 10**9}
    task = asyncio.create_task(_drops_cancels(state))
    await asyncio.sleep(0.01)
    stuck = await cancel_and_wait([task], timeout_s=0.5, grace_s=0.1)
    assert stuck == {task} and state["cancels"] >= 2  # cancelled again after the grace period
    state["drop"] = 0
    task.cancel()  # now it does stop (within the test, for the loop's sake)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_loops_of_redis_commands_all_stop(redis_url: str) -> None:
    """The case behind the helper: tasks looping over Redis commands, each cancelled at a random
    moment, all end (a single cancel loses some of them on Python 3.11)."""
    redis = connect(redis_url)

    async def loop() -> None:
        while True:
            await redis.get("streamrl-test-cancel")
            await asyncio.sleep(0)

    try:
        tasks = []
        for _ in range(40):
            task = asyncio.create_task(loop())
            await asyncio.sleep(random.random() * 0.02)
            tasks.append(task)
            assert await cancel_and_wait([task], timeout_s=10.0, grace_s=0.2) == set()
        assert all(t.cancelled() for t in tasks)
    finally:
        await redis.aclose()


async def test_bounded_stops_an_overrunning_step_and_logs_failures(caplog: pytest.LogCaptureFixture) -> None:
    state = {"cancels": 0, "drop": 3}
    overrun = asyncio.ensure_future(_drops_cancels(state))
    with caplog.at_level(logging.WARNING, logger="shared.tasks"):
        await bounded(overrun, "the slow step", 0.2)
        assert overrun.cancelled() and state["cancels"] == 4

        async def fails() -> None:
            raise RuntimeError("disk full")

        await bounded(fails(), "the failing step", 1.0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("the slow step did not finish within 0s; stopped" in m for m in messages)
    assert any("the failing step failed: RuntimeError: disk full" in m for m in messages)


async def test_a_cancelled_caller_stops_its_bounded_step() -> None:
    step = asyncio.ensure_future(asyncio.sleep(60))
    caller = asyncio.create_task(bounded(step, "a step", 60.0))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert step.cancelled()

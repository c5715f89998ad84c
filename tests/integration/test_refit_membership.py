"""Refit membership follows scaling, against a real Valkey: every refit re-reads the registry, so a
generator that joined since the last refit is waited for, one that is still starting or already
draining is not, and one that leaves or starts draining mid-refit is dropped (named in the report
and counted) instead of failing the refit. The generators are played by the test (heartbeat and
WeightAck), as in test_refit.py."""

from __future__ import annotations

import asyncio

import pytest

from services.trainer.refit import RefitError
from shared.registry import remove_worker
from tests.support.refit import played, publisher_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def publisher(redis_url, tmp_path):
    # trainer.refit_timeout_s: the played generators, on this test's event loop, answer well within
    # it even when a loaded machine stalls the loop for seconds.
    async with publisher_for(redis_url, tmp_path, "members", timeout_s=5.0) as pub_streams:
        yield pub_streams


async def test_a_generator_that_joined_is_waited_for_at_the_next_refit(publisher):
    pub, streams = publisher
    await played(streams, "gen-0").beat()
    asyncio.create_task(played(streams, "gen-0").answer(1))
    assert (await pub.refit(1)).generators == ["gen-0"]
    await played(streams, "gen-1").beat()  # scaled up between two refits
    asyncio.create_task(played(streams, "gen-0").answer(2))
    with pytest.raises(RefitError, match="by generator\\(s\\): gen-1"):
        await pub.refit(2)  # the newcomer is expected: its silence fails the refit by name
    both = asyncio.gather(played(streams, "gen-0").answer(3), played(streams, "gen-1").answer(3))
    report = await pub.refit(3)
    await both
    assert report.generators == ["gen-0", "gen-1"] and report.dropped == []


async def test_starting_and_draining_generators_are_not_waited_for(publisher):
    pub, streams = publisher
    await played(streams, "gen-0").beat()
    await played(streams, "gen-new").beat(state="starting")  # catches up by itself once its engine is up
    await played(streams, "gen-old").beat(state="draining")  # leaving: must not hold the refit
    asyncio.create_task(played(streams, "gen-0").answer(1))
    report = await pub.refit(1)
    assert report.generators == ["gen-0"] and report.dropped == []


async def test_a_generator_that_leaves_or_drains_mid_refit_is_dropped_and_counted(publisher):
    pub, streams = publisher
    for wid in ("gen-0", "gen-1", "gen-2"):
        await played(streams, wid).beat()

    async def scale_down_then_ack() -> None:
        while not await streams.redis.xlen(streams.keys.weights):
            await asyncio.sleep(0.02)
        await played(streams, "gen-1").beat(state="draining")  # SIGTERM arrived: it leaves routing first
        await remove_worker(streams.redis, streams.keys, "gen-2")  # gone without a word
        await played(streams, "gen-0").answer(4)

    asyncio.create_task(scale_down_then_ack())
    report = await pub.refit(4)
    assert report.generators == ["gen-0"]
    assert sorted(report.dropped) == ["gen-1", "gen-2"] and pub.dropped_total == 2


async def test_the_start_up_refit_waits_for_a_generator_that_can_confirm(publisher):
    pub, streams = publisher
    await played(streams, "gen-0").beat(state="starting")
    with pytest.raises(RefitError, match="no generator registered"):
        await pub.refit(0, wait_for_generators_s=0.5)

    async def come_up() -> None:
        await asyncio.sleep(0.3)
        await played(streams, "gen-0").beat()
        await played(streams, "gen-0").answer(0)

    asyncio.create_task(come_up())
    assert (await pub.refit(0, wait_for_generators_s=60.0)).generators == ["gen-0"]

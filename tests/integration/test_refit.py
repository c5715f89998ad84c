"""Refit against a real Valkey: the trainer publishes a version and waits for every registered
generator; a silent or failing generator fails the refit loudly, with its name, within the deadline.
The generator side is played by the test (registry heartbeat + WeightAck), as a generator would."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.trainer.refit import RefitError
from shared.weights_format import checksum_dir
from tests.support.refit import played, publisher_for

pytestmark = pytest.mark.integration


# The refit deadline (trainer.refit_timeout_s): the played generators, on this test's event loop,
# answer well within it even when a loaded machine stalls the loop for seconds.
REFIT_TIMEOUT_S = 5.0


@pytest.fixture
async def publisher(redis_url, tmp_path):
    async with publisher_for(redis_url, tmp_path, "refit", timeout_s=REFIT_TIMEOUT_S) as pub_streams:
        yield pub_streams


async def test_refit_completes_when_every_generator_confirms(publisher):
    pub, streams = publisher
    await played(streams, "gen-a").beat()
    await played(streams, "gen-b").beat()
    answers = asyncio.gather(
        played(streams, "gen-a").answer(cache_reset=True), played(streams, "gen-b").answer(cache_reset=True)
    )
    report = await pub.refit(3)
    ann, _ = await answers
    assert report.generators == ["gen-a", "gen-b"] and report.version == 3
    assert ann.mode == "drain" and ann.checksum == checksum_dir(ann.path)
    assert await pub.pause.reasons() == {}  # the launch gate is open again


async def test_a_silent_generator_fails_the_refit_by_name_within_the_deadline(publisher):
    pub, streams = publisher
    await played(streams, "gen-a").beat()
    await played(streams, "gen-silent").beat()
    asyncio.create_task(played(streams, "gen-a").answer(cache_reset=True))
    t0 = time.monotonic()
    with pytest.raises(
        RefitError, match=rf"not confirmed within {REFIT_TIMEOUT_S:.0f}s \(trainer.refit_timeout_s\) by .*gen-silent"
    ) as err:
        await pub.refit(1)
    assert "gen-a" not in str(err.value)
    # The requirement: it fails at trainer.refit_timeout_s instead of waiting on; the margin over
    # the deadline is for a loaded machine, far short of a refit that waits for ever.
    assert time.monotonic() - t0 < REFIT_TIMEOUT_S + 30
    assert await pub.pause.reasons() == {}


async def test_a_failed_load_fails_the_refit_with_the_generators_error(publisher):
    pub, streams = publisher
    await played(streams, "gen-a").beat()
    asyncio.create_task(played(streams, "gen-a").answer(ok=False, error="checksum mismatch"))
    with pytest.raises(RefitError, match="gen-a failed to load weight version 2: checksum mismatch"):
        await pub.refit(2)


async def test_no_generator_at_all_is_a_clear_error(publisher):
    pub, _ = publisher
    with pytest.raises(RefitError, match="no generator registered"):
        await pub.refit(0, wait_for_generators_s=0.5)


async def test_a_weight_write_that_hangs_fails_the_refit_and_reopens_the_gate(publisher):
    pub, streams = publisher
    await played(streams, "gen-a").beat()
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stuck_save(path):
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()  # a filesystem that never returns

    pub.transport.export = stuck_save
    with pytest.raises(RefitError, match="moving weight version 4"):
        await pub.refit(4)
    assert await pub.pause.reasons() == {}
    assert await streams.redis.xlen(streams.keys.weights) == 0  # nothing was announced
    release.set()

"""The run's pause protocol (`shared.pause`) against a real Valkey: which reasons close the launch
gate, which stop training-task issue, epochs, and what an older reader does with a reason it does
not know."""

from __future__ import annotations

import uuid

import pytest

from shared import keys as K
from shared.pause import PauseControl, PauseReason, launch_gate_closed, read_pauses
from shared.streams import connect

pytestmark = pytest.mark.integration


@pytest.fixture
async def pauses(redis_url):
    redis = connect(redis_url)
    keys = K.RunKeys(f"pause-{uuid.uuid4().hex[:6]}")
    yield redis, keys, PauseControl(redis, keys)
    await redis.aclose()


@pytest.mark.parametrize(
    ("reason", "gate", "issue"),
    [(PauseReason.USER, True, True), (PauseReason.REFIT, True, False), (PauseReason.VALIDATION, False, True)],
)
async def test_each_reason_closes_what_the_table_says(pauses, reason, gate, issue):
    redis, keys, pc = pauses
    assert not await launch_gate_closed(redis, keys) and not await pc.stops_task_issue()
    epoch = await pc.pause(reason)
    assert await launch_gate_closed(redis, keys) is gate
    assert await pc.stops_task_issue() is issue
    assert await pc.active(reason) == epoch and await read_pauses(redis, keys) == {reason.value: epoch}
    assert await pc.resume(reason, epoch)
    assert not await launch_gate_closed(redis, keys) and await pc.reasons() == {}


async def test_reasons_are_counted_apart_and_a_stale_epoch_ends_nothing(pauses):
    redis, keys, pc = pauses
    user = await pc.pause(PauseReason.USER)
    refit = await pc.pause(PauseReason.REFIT)
    assert await pc.resume(PauseReason.REFIT, refit)
    assert await launch_gate_closed(redis, keys)  # the user pause still holds the gate
    newer = await pc.pause(PauseReason.USER)
    assert not await pc.resume(PauseReason.USER, user)  # the older epoch cannot end the newer pause
    assert await pc.active(PauseReason.USER) == newer


async def test_a_reason_from_a_newer_writer_closes_the_gate(pauses):
    redis, keys, _ = pauses
    await redis.hset(keys.pause, "maintenance", "7")
    assert await launch_gate_closed(redis, keys)
    assert await read_pauses(redis, keys) == {"maintenance": 7}

"""`services.gym_gateway.external.ExternalSessions` on its own, the worker's side played by the
test: claims go to the oldest waiting task, once; a complete is taken once, and only while the
rollout can still use it (a second one, one that comes as the rollout ends or after it are 409s);
a claimed session that cannot start answers its agent with a 503; a drain names the unclaimed
tasks and hands out no more. Also the complete's body, and the 400 naming a missing or unknown
field (`shared.http.decode_body`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from services.gym_gateway.envs.base import Outcome
from services.gym_gateway.external import CompleteRequest, ExternalSessions
from shared.http import HTTPError, decode_body
from shared.protocol import SamplingParams, Task
from tests.support.messages import make_task

pytestmark = pytest.mark.unit


def _task(i: int) -> Task:
    return make_task(
        f"t{i}",
        group_size=2,
        prompt_index=i,
        env="external",
        instance={"row": i},
        sampling=SamplingParams(max_tokens=16),
        deadline_s=5.0,
    )


def _client(session_id: str) -> SimpleNamespace:
    """What the worker hands the rollout: the session's URL and deadline, and its proxy."""
    recorded = SimpleNamespace(calls=2, prefix_breaks=1)
    return SimpleNamespace(
        session_id=session_id,
        base_url=f"http://gw/sessions/{session_id}/v1",
        timeout_s=5.0,
        proxy=SimpleNamespace(session=lambda _sid: recorded),
    )


async def _serving(ext: ExternalSessions, i: int) -> tuple[asyncio.Task, asyncio.Task]:
    """Task ``i`` offered, claimed and handed to its agent: (the worker's rollout, the claim)."""
    offer = asyncio.create_task(ext.wait_claim(_task(i), f"s{i}"))
    await asyncio.sleep(0)
    claim = asyncio.create_task(ext.claim())
    await offer
    rollout = asyncio.create_task(ext.rollout(_task(i).instance, _client(f"s{i}"), max_turns=3))
    await asyncio.sleep(0)
    return rollout, claim


async def test_claims_go_to_the_oldest_waiting_task_once():
    ext = ExternalSessions()
    assert await ext.claim() is None
    offers = [asyncio.create_task(ext.wait_claim(_task(i), f"s{i}")) for i in (1, 2)]
    await asyncio.sleep(0)
    assert ext.waiting == 2
    claim = asyncio.create_task(ext.claim())
    await offers[0]
    assert not offers[1].done() and ext.waiting == 1
    rollout = asyncio.create_task(ext.rollout({"row": 1}, _client("s1"), max_turns=3))
    grant = await claim
    assert (grant.session_id, grant.task_id, grant.instance, grant.max_turns) == ("s1", "t1/0", {"row": 1}, 3)
    assert grant.base_url == "http://gw/sessions/s1/v1" and grant.complete_url == "http://gw/sessions/s1/complete"
    assert grant.sampling.max_tokens == 16 and grant.deadline_s == 5.0
    rollout.cancel()
    offers[1].cancel()
    await asyncio.gather(rollout, offers[1], return_exceptions=True)


async def test_a_complete_is_taken_once():
    ext = ExternalSessions()
    rollout, _ = await _serving(ext, 1)
    done = await ext.complete("s1", Outcome(reward=1.0))
    assert (done.task_id, done.model_calls, done.prefix_breaks) == ("t1/0", 2, 1)
    assert (await rollout).reward == 1.0
    with pytest.raises(HTTPError) as twice:
        await ext.complete("s1", Outcome(reward=0.0))
    assert twice.value.status == 409 and "already completed" in twice.value.message
    ext.end("s1", "completed")
    with pytest.raises(HTTPError) as late:
        await ext.complete("s1", Outcome(reward=0.0))
    assert late.value.status == 409 and "has ended (completed)" in late.value.message
    with pytest.raises(HTTPError) as unknown:
        await ext.complete("s9", Outcome(reward=0.0))
    assert unknown.value.status == 404 and unknown.value.param == "session_id"
    assert ext.holds("s1") and not ext.holds("s9")


async def test_an_outcome_that_comes_as_the_rollout_ends_is_refused():
    ext = ExternalSessions()
    rollout, _ = await _serving(ext, 1)
    complete = asyncio.create_task(ext.complete("s1", Outcome(reward=1.0)))
    await asyncio.sleep(0)  # the outcome is handed over ...
    rollout.cancel()  # ... and the deadline ends the rollout before it took it
    with pytest.raises(asyncio.CancelledError):
        await rollout
    ext.end("s1", "timeout: rollout deadline passed")
    with pytest.raises(HTTPError) as refused:
        await complete
    assert refused.value.status == 409 and "timeout" in refused.value.message


async def test_a_claimed_session_that_cannot_start_answers_its_agent_with_503():
    ext = ExternalSessions()
    offer = asyncio.create_task(ext.wait_claim(_task(1), "s1"))
    await asyncio.sleep(0)
    claim = asyncio.create_task(ext.claim())
    await offer
    ext.end("s1", "no_generator: no serving generator registered within 30s")
    with pytest.raises(HTTPError) as refused:
        await claim
    assert refused.value.status == 503 and "no_generator" in refused.value.message


async def test_a_drain_names_the_unclaimed_tasks_and_hands_out_no_more():
    ext = ExternalSessions()
    rollout, _ = await _serving(ext, 1)
    offer = asyncio.create_task(ext.wait_claim(_task(2), "s2"))
    await asyncio.sleep(0)
    assert ext.close() == ["t2/0"]
    assert await ext.claim() is None
    for t in (rollout, offer):
        t.cancel()
    await asyncio.gather(rollout, offer, return_exceptions=True)


def test_the_complete_body_becomes_the_outcome():
    flagged = decode_body(b'{"reward": 0.5, "mask_sample": true, "metrics": {"steps": 3}}', CompleteRequest).outcome()
    assert (flagged.reward, flagged.status, flagged.mask_sample, flagged.metrics) == (
        0.5,
        "env_flagged",
        True,
        {"steps": 3},
    )
    plain = decode_body(b'{"reward": 1}', CompleteRequest).outcome()
    assert (plain.status, plain.mask_sample, plain.metrics) == ("ok", False, {})


class _Inner(msgspec.Struct, forbid_unknown_fields=True):
    size: int


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    inner: _Inner | None = None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{}", "name"),
        (b'{"name": "a", "colour": 1}', "colour"),
        (b'{"name": "a", "inner": {}}', "inner.size"),
        (b'{"name": "a", "inner": {"size": 1, "unit": "m"}}', "inner.unit"),
        (b'{"name": 3}', "name"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(body, param):
    with pytest.raises(HTTPError) as bad:
        decode_body(body, _Body)
    assert bad.value.status == 400 and bad.value.param == param

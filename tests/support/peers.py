"""A generator and a gateway played through Redis as they speak the protocol, for tests of the
trainer (control plane, refit) without a model or an engine behind them.

* `FakeGenerator`: registers (registry heartbeat) and confirms weight versions (`WeightAck`):
  ``confirm_new`` acks every announcement since a cursor, as a running generator does;
  ``answer`` waits for the latest announcement (of a given version) and acks it once, as the refit
  tests play one generator of many.
* `FakeGateway`: reads tasks (never while the launch gate is closed) and answers each with a
  one-turn trajectory once ``finish(task)`` allows (or, where ``failure(task)`` names one, with
  the placeholder of a rollout failed for an infrastructure reason); a task it may not finish yet
  stays in ``running`` (entry id, task, read at) and is offered again.
* `Peers`: the pair on one connection, looping until cancelled (``run``).

Used by the control-plane tests (tests/integration/test_control_plane.py, test_validation_drain.py,
test_dynamic_sampling.py) and the refit tests (test_refit.py, test_refit_membership.py,
tests/faults/test_refit_redis_pause.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.gym_gateway.envs.base import Outcome
from services.gym_gateway.proxy import Session
from services.gym_gateway.worker import Failure, assemble
from shared import keys as K
from shared.pause import launch_gate_closed
from shared.protocol import Task, Trajectory, WeightAck, WeightAnnouncement
from shared.registry import publish_heartbeat
from shared.streams import StreamClient, connect
from tests.support.messages import make_heartbeat, one_turn


class FakeGenerator:
    """Generator ``worker_id`` at ``url``, played on ``streams`` (its registry record says which
    weight version it serves: ``version``, -1 before the first)."""

    def __init__(self, streams: StreamClient, worker_id: str = "gen-peer", url: str = "http://peer") -> None:
        self.streams = streams
        self.worker_id = worker_id
        self.url = url
        self.version = -1

    async def beat(self, state: str = "ready") -> None:
        """One registry heartbeat, as the generator sends it every few seconds."""
        hb = make_heartbeat(self.worker_id, url=self.url, state=state, weight_version=self.version)
        await publish_heartbeat(self.streams.redis, self.streams.keys, hb)

    async def ack(self, version: int, *, ok: bool = True, error: str | None = None, cache_reset: bool = False) -> None:
        ack = WeightAck(worker_id=self.worker_id, version=version, ok=ok, error=error, cache_reset=cache_reset)
        await self.streams.publish(self.streams.keys.weight_acks, ack)

    async def confirm_new(self, cursor: str, block_ms: int) -> str:
        """Serve and ack (cache reset) every version announced after ``cursor``; the new cursor."""
        keys = self.streams.keys
        for d in await self.streams.read_after(keys.weights, cursor, WeightAnnouncement, block_ms=block_ms):
            cursor, self.version = d.entry_id, d.msg.version
            await self.beat()
            await self.ack(self.version, cache_reset=True)
        return cursor

    async def answer(
        self,
        version: int | None = None,
        *,
        ok: bool = True,
        error: str | None = None,
        cache_reset: bool = False,
        load_s: float = 0.0,
        poll_s: float = 0.02,
    ) -> WeightAnnouncement:
        """Wait for the latest announcement (of ``version`` when given), take ``load_s`` to load
        it, and ack it once; the announcement."""
        while True:
            latest = await self.streams.read_latest(self.streams.keys.weights, WeightAnnouncement)
            if latest is not None and version in (None, latest.msg.version):
                break
            await asyncio.sleep(poll_s)
        await asyncio.sleep(load_s)
        await self.ack(latest.msg.version, ok=ok, error=error, cache_reset=cache_reset)
        return latest.msg


class FakeGateway:
    """Gateway ``gw-peer``, played on ``streams``: ``finish(task)`` says whether a task it read
    finishes now; ``reward(task)`` scores it (1 for odd rows of a group, so no group's rewards
    tie). Its trajectories carry when it read the task and when it finished it."""

    def __init__(self, streams: StreamClient) -> None:
        self.streams = streams
        self.finish: Callable[[Task], bool] = lambda task: True
        self.reward: Callable[[Task], float] = lambda task: float(task.index_in_group % 2)
        self.failure: Callable[[Task], Failure | None] = lambda task: None
        self.running: list[tuple[str, Task, float]] = []  # entry id, task, read at

    async def serve(self, version: int) -> None:
        """Read what the launch gate lets through, and answer what may finish (by weights ``version``)."""
        keys = self.streams.keys
        if not await launch_gate_closed(self.streams.redis, keys):
            got = await self.streams.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=64, block_ms=20)
            self.running += [(d.entry_id, d.msg, time.time()) for d in got]
        still = []
        for entry_id, task, started_at in self.running:
            if not self.finish(task):
                still.append((entry_id, task, started_at))
                continue
            traj = self._trajectory(task, version, started_at)
            await self.streams.publish_and_ack(keys.trajectories, traj, keys.tasks, K.GATEWAYS_GROUP, entry_id)
        self.running = still

    def _trajectory(self, task: Task, version: int, started_at: float) -> Trajectory:
        """The gateway's own record of a one-turn rollout."""
        turns = [one_turn(version)]
        session = Session("s", task.kind, task.sampling, "gen-peer", "http://peer", version, env=task.env, turns=turns)
        failure = self.failure(task)
        outcome = None if failure else Outcome(reward=self.reward(task))
        return assemble(task, session, outcome, failure, "gw-peer", started_at)


class Peers:
    """A `FakeGenerator` and a `FakeGateway` of run ``keys``, on a connection of their own
    (``redis``: the caller closes it)."""

    def __init__(self, redis_url: str, keys: K.RunKeys) -> None:
        self.redis = connect(redis_url)
        self.keys = keys
        self.generator = FakeGenerator(StreamClient(self.redis, keys, "gen-peer"))
        self.gateway = FakeGateway(StreamClient(self.redis, keys, "gw-peer"))

    async def run(self) -> None:
        await self.gateway.streams.ensure_group(self.keys.tasks, K.GATEWAYS_GROUP)
        cursor = "0-0"
        while True:
            await self.generator.beat()
            cursor = await self.generator.confirm_new(cursor, block_ms=20)
            await self.gateway.serve(self.generator.version)
            await asyncio.sleep(0.05)

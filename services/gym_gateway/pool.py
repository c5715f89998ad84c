"""The generator pool: which generator a new session (or a failover) goes to.

Reads the registry's generators at most every ``refresh_s`` and picks, round robin, a serving one
(state ``ready``, ``loading`` or ``paused``, with a weight version) that was not found dead in the
last ``SUSPECT_S`` and that the fleet's health (`shared.fleet_health`) calls ``serving``. Every
``HealthPolicy.publish_s`` it also publishes this gateway's window of calls (`calls`, filled by the
session proxy) and re-reads the fleet's health, writing the verdicts back as the fleet's memory.

    refresh: registry -> ready generators --every publish_s--> publish calls, read fleet health
    pick:    ready - exclude - found dead -> serving ones (none: every one left, logged) -> round robin

Degraded, draining and lost generators take no new sessions while any serving one exists; with
none, sessions go to the rest rather than nowhere. Sessions already on a degraded generator stay
there (their prefix cache is there). Built by the gateway app with `services.gym_gateway.proxy`;
the app runs `keep_health` in the background, so a worker whose sessions are all long still
publishes its calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import redis.asyncio as aioredis

from services.gym_gateway.call_window import CallWindow
from shared import keys as K
from shared.fleet_health import DEFAULT_POLICY, GeneratorHealth, HealthPolicy, fleet_health, publish_calls
from shared.protocol import Heartbeat
from shared.registry import default_worker_id, live_workers

log = logging.getLogger(__name__)


class NoGenerator(RuntimeError):
    """No generator can take a session: an infrastructure failure."""


class GeneratorPool:
    """Ready generators from the registry, refreshed at most every ``refresh_s``, routed by health."""

    def __init__(
        self,
        redis: aioredis.Redis,
        run_keys: K.RunKeys,
        refresh_s: float = 1.0,
        *,
        gateway_id: str = "",
        health_policy: HealthPolicy = DEFAULT_POLICY,
    ) -> None:
        self.redis = redis
        self.keys = run_keys
        self.refresh_s = refresh_s
        self.gateway_id = gateway_id or default_worker_id("gym_gateway")
        self.health_policy = health_policy
        self.calls = CallWindow(health_policy.window_s)  # filled by the session proxy
        self.health: dict[str, GeneratorHealth] = {}  # the fleet's, as last read
        self._ready: list[Heartbeat] = []
        self._at = 0.0
        self._health_at = float("-inf")
        self._seen: dict[str, tuple[str, float]] = {}  # generator id -> (last state, started_at) seen
        self._fallback = False  # routing to unhealthy generators for want of healthy ones (logged once)
        self._rr = itertools.count()
        self._refresh_lock = asyncio.Lock()
        self._dead: dict[str, tuple[float, float]] = {}  # worker id -> (monotonic, wall) when found dead

    # A generator mid-refit queues requests until it resumes, so it still takes sessions.
    SERVING_STATES = ("ready", "loading", "paused")

    # A generator found dead stays out of routing this long, unless its heartbeat says it restarted.
    SUSPECT_S = 30.0

    async def pick(self, wait_s: float = 30.0, exclude: frozenset[str] = frozenset()) -> tuple[str, str, int]:
        """(worker id, base url, weight version) of a serving generator, round robin, other than
        ``exclude`` and the ones recently found dead, healthy ones first; waits up to ``wait_s``
        for one to appear, then raises NoGenerator."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            if now - self._at > self.refresh_s or not self._ready:
                await self._refresh(now)
            usable = self._healthy([g for g in self._ready if g.worker_id not in exclude and not self._suspect(g, now)])
            if usable:
                g = usable[next(self._rr) % len(usable)]
                return g.worker_id, g.url, g.weight_version
            if now > deadline:
                raise NoGenerator(f"no serving generator registered within {wait_s:.0f}s")
            await asyncio.sleep(self.refresh_s / 2)

    def mark_dead(self, worker_id: str) -> None:
        """Keep ``worker_id`` out of routing for SUSPECT_S (a later heartbeat from a restarted
        process with a newer start time brings it back at once)."""
        self._dead[worker_id] = (time.monotonic(), time.time())

    def _suspect(self, g: Heartbeat, now: float) -> bool:
        mark = self._dead.get(g.worker_id)
        if mark is None:
            return False
        if now - mark[0] > self.SUSPECT_S or g.started_at > mark[1]:
            del self._dead[g.worker_id]
            return False
        return True

    def _healthy(self, usable: list[Heartbeat]) -> list[Heartbeat]:
        """The serving ones of ``usable`` (no verdict yet counts as serving); all of them when none is."""
        serving = [g for g in usable if self._state(g.worker_id) == "serving"]
        if serving or not usable:
            self._fallback = False
            return serving
        if not self._fallback:
            self._fallback = True
            states = ", ".join(f"{g.worker_id} {self._state(g.worker_id)}" for g in usable)
            log.warning("no serving generator is healthy (%s): routing to them anyway", states)
        return usable

    async def keep_health(self) -> None:
        """Publish and re-read at least every ``publish_s`` even while no session opens: long
        rollouts keep calling their generators, and the fleet must see those calls. Redis away:
        logged, tried again next time (the picks' own reads fail loudly meanwhile)."""
        while True:
            await asyncio.sleep(self.health_policy.publish_s)
            if time.monotonic() - self._health_at < self.health_policy.publish_s:
                continue  # a pick refreshed it already
            try:
                await self._refresh(time.monotonic())
            except Exception as exc:
                log.warning("could not refresh the generators' health: %s: %s", type(exc).__name__, exc)

    def _state(self, worker_id: str) -> str:
        h = self.health.get(worker_id)
        return "serving" if h is None else h.state

    async def _refresh(self, stale_before: float) -> None:
        """One registry read for a burst of sessions: callers that waited on the lock find the
        view refreshed after ``stale_before`` and return without reading again."""
        async with self._refresh_lock:
            if self._at > stale_before and self._ready:
                return
            gens = await live_workers(self.redis, self.keys, "generator")
            self._ready = [g for g in gens if g.state in self.SERVING_STATES and g.weight_version >= 0]
            self._at = time.monotonic()
            self._note_states(gens)
            if self._at - self._health_at >= self.health_policy.publish_s:
                self._health_at = self._at
                await self._refresh_health(gens)

    def _note_states(self, gens: list[Heartbeat]) -> None:
        """Remember each generator's last state (a drained one leaves on purpose, `fleet_health`);
        a restarted process's calls start afresh."""
        for g in gens:
            before = self._seen.get(g.worker_id)
            if before is not None and g.started_at > before[1]:
                self.calls.forget(g.worker_id)
            self._seen[g.worker_id] = (g.state, g.started_at)

    async def _refresh_health(self, gens: list[Heartbeat]) -> None:
        """Publish this gateway's calls, then read (and record) the fleet's health."""
        summaries = self.calls.summaries(self.gateway_id, {gid: s for gid, (s, _) in self._seen.items()})
        await publish_calls(self.redis, self.keys, summaries)
        health = await fleet_health(self.redis, self.keys, policy=self.health_policy, heartbeats=gens)
        for gid, h in health.items():
            old = self.health.get(gid)
            if h.state != "serving" and (old is None or old.state != h.state):
                log.warning("generator %s is %s: %s", gid, h.state, h.reason)
            elif h.state == "serving" and old is not None and old.state != "serving":
                log.info("generator %s is serving again (was %s)", gid, old.state)
        self.health = health
        keep = {g.worker_id for g in gens} | {s.worker_id for s in summaries}
        for gid in [g for g in self._seen if g not in keep]:
            del self._seen[gid]  # neither registered nor called any more: nothing left to say of it

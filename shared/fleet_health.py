"""The generator fleet's health: each generator serving, degraded, draining or lost, from what the
worker registry and the gateways' session proxies see.

    gateway proxies --CallSummary per (gateway, generator), every publish_s--> generators:calls
    registry heartbeats ----------------------------------------------------+
    generators:health (the fleet's memory: state, since, recovering since) --+--> assess_fleet
                                                                                  |
    GeneratorPool (routing), trainer (/status, autoscaler), streamrl status <----+

States (`GeneratorHealth.state`)::

    serving  --too many errors, or slow against its peers--> degraded
    degraded --judged healthy for recover_s in a row-------> serving
    any      --heartbeat "draining"------------------------> draining  (gone after it: forgotten)
    any      --heartbeat "failed", heartbeat gone, or every recent call refused--> lost
    lost     --forget_lost_s without a heartbeat-----------> forgotten

A generator that is starting or mid-refit (``starting``, ``loading``, ``paused``,
``awaiting_weights``) is not judged: requests queue behind its gate by design. A restarted
process (a newer ``started_at``) starts with a clean record.

`fleet_health` reads everything from Redis; `assess_fleet` is the pure rule over heartbeats,
call summaries and the previous verdicts. Gateways publish with `publish_calls`
(`services.gym_gateway.call_window` keeps their windows). Readers write the verdicts back as the
fleet's memory (the gateways' pools, the trainer's autoscaler), so hysteresis and lost
generators survive any one reader; ``record=False`` (``streamrl status``, ``GET /status``) only
reads.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import msgspec
import redis.asyncio as aioredis

from shared import keys as K
from shared.protocol import Heartbeat, ProtocolError, _Message, decode, encode
from shared.queue_stats import worker_views
from shared.redis_replies import as_bytes

log = logging.getLogger(__name__)

M = TypeVar("M", bound=_Message)

HealthState = Literal["serving", "degraded", "draining", "lost"]

# A generator in one of these heartbeat states is starting or mid-refit: its calls wait behind the
# gate until it resumes, so it is not judged slow (see services.generator.runtime's lifecycle).
NOT_JUDGED_STATES = frozenset({"starting", "loading", "paused", "awaiting_weights"})


class HealthPolicy(msgspec.Struct, kw_only=True, frozen=True):
    """The thresholds of the health rule. The defaults, and why:

    * ``window_s`` 60: long enough for a busy generator to gather ``min_calls`` (agent turns take
      seconds), short enough that a fault that ended is out of the window within a minute.
    * ``min_calls`` 10: fewer calls say little. One transient error would be a 100 % error rate,
      one long prefill a 10x median; ten calls put the error fraction in steps of 0.1 and keep the
      median robust to four outliers.
    * ``max_error_fraction`` 0.25: a healthy generator answers 5xx, drops connections or times out
      essentially never; two bad calls of ten (a blip) stay serving, one in four is a fault.
    * ``slow_factor`` 3.0: peers serve the same model and the same mix of tasks, so their medians
      per token agree to within about 1.5x (batch sizes, prompt lengths); 3x is a sick machine
      (a throttled or degraded GPU, a noisy neighbour, a bad link) that holds back every group
      whose rollouts it serves.
    * ``lost_after_connection_errors`` 3: with a live heartbeat, a generator the gateways cannot
      reach at all (every one of at least 3 calls refused or dropped) is lost, not slow.
    * ``recover_s`` 30: a degraded generator must be judged healthy this long in a row before it
      takes new sessions again, so routing does not flap on a median near the bound. It takes no
      new sessions while degraded, so its window empties (within ``window_s``) and it then
      recovers: a degraded generator is retried every ``window_s + recover_s`` at most.
    * ``forget_lost_s`` 600: a lost generator is reported for ten minutes (time to replace it),
      then forgotten.
    * ``publish_s`` 5: each gateway publishes its windows and re-reads the fleet's health this
      often: one small hash write and two hash reads per gateway, whatever the call rate.
    """

    window_s: float = 60.0  # calls older than this are forgotten
    min_calls: int = 10  # calls (and latencies) in the window before a generator is judged
    max_error_fraction: float = 0.25  # more errors than this fraction of the calls: degraded
    slow_factor: float = 3.0  # median latency per token above this times its peers': degraded
    lost_after_connection_errors: int = 3  # that many calls, every one refused: lost
    recover_s: float = 30.0  # healthy this long in a row before a degraded one serves again
    forget_lost_s: float = 600.0  # a lost generator is forgotten after this long without a heartbeat
    publish_s: float = 5.0  # how often a gateway publishes its calls and re-reads the health


DEFAULT_POLICY = HealthPolicy()


class CallSummary(_Message, tag="generator_calls", kw_only=True):
    """One gateway's calls to one generator in its window (written by `publish_calls`)."""

    gateway_id: str
    worker_id: str  # the generator
    calls: int  # every call that got an answer or failed: ok + errors
    errors: int  # HTTP 5xx, connection errors and timeouts
    connection_errors: int = 0  # refused, reset or dropped
    timeouts: int = 0  # no answer within gym_gateway.request_timeout_s
    latency_calls: int = 0  # ok calls with a latency per token (not spanning a refit)
    latency_sum_s: float = 0.0  # their latencies per generated token (per call without tokens)
    latency_median_s: float | None = None
    window_start: float = 0.0  # unix time of the oldest call in the window
    window_end: float = 0.0  # unix time the summary was made
    heartbeat_state: str = ""  # the generator's last state in this gateway's registry view


class GeneratorHealth(_Message, tag="generator_health", kw_only=True):
    """One generator's verdict, and the figures behind it (summed over every gateway)."""

    worker_id: str
    state: HealthState
    reason: str  # human-readable: why this state
    since: float  # unix time it entered this state
    heartbeat_state: str = ""  # the registry's state; "" when it has no live heartbeat
    started_at: float = 0.0  # its process's start time, from the heartbeat
    calls: int = 0
    errors: int = 0
    connection_errors: int = 0
    latency_calls: int = 0
    latency_per_token_s: float | None = None  # median over the window
    latency_factor: float | None = None  # over the median of its peers' medians
    cause: str = ""  # while degraded: what made it so
    healthy_since: float | None = None  # while degraded: since when it is judged healthy again


@dataclass
class FleetCalls:
    """A generator's calls, summed over every gateway's fresh summary."""

    calls: int = 0
    errors: int = 0
    connection_errors: int = 0
    latency_calls: int = 0
    latency_median_s: float | None = None
    heartbeat_state: str = ""
    seen_at: float = 0.0


def merge_calls(summaries: Iterable[CallSummary], *, now: float, window_s: float) -> dict[str, FleetCalls]:
    """Per generator: the summaries younger than ``window_s`` summed; the median latency is the
    gateways' medians weighted by their calls (exact for one gateway, close for many); the
    heartbeat state is the newest any gateway saw, "draining" if one saw that."""
    out: dict[str, FleetCalls] = {}
    medians: dict[str, list[tuple[float, int]]] = {}
    for s in summaries:
        if s.window_end < now - window_s:
            continue
        f = out.setdefault(s.worker_id, FleetCalls())
        f.calls += s.calls
        f.errors += s.errors
        f.connection_errors += s.connection_errors
        f.latency_calls += s.latency_calls
        if f.heartbeat_state != "draining" and (s.window_end >= f.seen_at or s.heartbeat_state == "draining"):
            f.heartbeat_state = s.heartbeat_state  # one gateway saw it drain: it did
        f.seen_at = max(f.seen_at, s.window_end)
        if s.latency_median_s is not None and s.latency_calls:
            medians.setdefault(s.worker_id, []).append((s.latency_median_s, s.latency_calls))
    for gid, weighted in medians.items():
        weighted.sort()
        half, acc = sum(n for _, n in weighted) / 2, 0
        for value, n in weighted:
            acc += n
            if acc >= half:
                out[gid].latency_median_s = value
                break
    return out


def assess_fleet(
    heartbeats: Iterable[Heartbeat],
    calls: Iterable[CallSummary],
    *,
    now: float,
    policy: HealthPolicy = DEFAULT_POLICY,
    previous: Mapping[str, GeneratorHealth] | None = None,
) -> dict[str, GeneratorHealth]:
    """Every known generator's health: those with a live heartbeat (``heartbeats``: the
    registry's, other kinds ignored), those the gateways called in the window (``calls``) and
    those the previous verdicts remember. Pure: ``now`` is unix time."""
    previous = previous or {}
    beats = {hb.worker_id: hb for hb in heartbeats if hb.kind == "generator"}
    seen = merge_calls(calls, now=now, window_s=policy.window_s)
    medians = {
        gid: f.latency_median_s
        for gid, f in seen.items()
        if f.latency_median_s is not None and f.latency_calls >= policy.min_calls
    }
    out: dict[str, GeneratorHealth] = {}
    for gid in sorted(beats.keys() | seen.keys() | previous.keys()):
        hb, prev = beats.get(gid), previous.get(gid)
        if prev is not None and hb is not None and hb.started_at > prev.started_at:
            prev = None  # a new process under the same id: a clean record
        verdict = _Verdict(gid, hb, seen.get(gid) or FleetCalls(), _factor(gid, medians), prev, now, policy)
        health = verdict.judge()
        if health is not None:
            out[gid] = health
    return out


def _factor(gid: str, medians: Mapping[str, float]) -> float | None:
    """The generator's median latency per token over the median of its peers' medians; None
    without enough calls of its own or with no peer that has enough (nobody to be slow against)."""
    own = medians.get(gid)
    peers = [m for g, m in medians.items() if g != gid]
    if own is None or not peers:
        return None
    peer = statistics.median(peers)
    return own / peer if peer > 0 else None


@dataclass
class _Verdict:
    gid: str
    hb: Heartbeat | None
    seen: FleetCalls
    factor: float | None
    prev: GeneratorHealth | None
    now: float
    policy: HealthPolicy

    def judge(self) -> GeneratorHealth | None:
        hb, seen, prev, p = self.hb, self.seen, self.prev, self.policy
        if hb is None:
            return self._without_heartbeat()
        if hb.state == "failed":
            return self._become("lost", f"its heartbeat says failed: {hb.error or 'no error given'}")
        if hb.state == "draining":
            return self._become("draining", "draining (scale-down): finishing the sessions it serves")
        if seen.calls >= p.lost_after_connection_errors and seen.connection_errors == seen.calls:
            return self._become("lost", f"all {seen.calls} calls in the last {p.window_s:.0f} s failed to connect")
        degraded = prev is not None and prev.state == "degraded"
        if hb.state in NOT_JUDGED_STATES:
            if degraded and prev is not None:
                return self._become("degraded", prev.reason, cause=prev.cause, healthy_since=prev.healthy_since)
            return self._become("serving", f"{hb.state}: not judged until it serves")
        fault = self._fault()
        if fault is not None:
            return self._become("degraded", fault, cause=fault)
        if degraded and prev is not None:
            healthy_since = prev.healthy_since or self.now
            healthy_s = self.now - healthy_since
            if healthy_s < p.recover_s:
                why = f"recovering: healthy for {healthy_s:.0f} s of {p.recover_s:.0f} s; was {prev.cause}"
                return self._become("degraded", why, cause=prev.cause, healthy_since=healthy_since)
        return self._become("serving", self._figures())

    def _without_heartbeat(self) -> GeneratorHealth | None:
        prev = self.prev
        last = self.seen.heartbeat_state if self.seen.seen_at else (prev.heartbeat_state if prev else "")
        if (prev is not None and prev.state == "draining") or last == "draining":
            return None  # it drained and left: scaled down on purpose, not lost
        if prev is not None and prev.state == "lost" and self.now - prev.since > self.policy.forget_lost_s:
            return None
        return self._become("lost", f"no live heartbeat in the registry (last seen {last or 'gone'})")

    def _fault(self) -> str | None:
        seen, p = self.seen, self.policy
        if seen.calls >= p.min_calls and seen.errors > p.max_error_fraction * seen.calls:
            return f"errors {seen.errors}/{seen.calls} calls in the last {p.window_s:.0f} s"
        if self.factor is not None and self.factor > p.slow_factor:
            return f"{self.factor:.1f}x the fleet's median latency per token"
        return None

    def _figures(self) -> str:
        seen, p = self.seen, self.policy
        if seen.calls < p.min_calls:
            return f"{seen.calls} calls in the last {p.window_s:.0f} s: too few to judge"
        speed = f", {self.factor:.1f}x the fleet's median latency per token" if self.factor is not None else ""
        return f"errors {seen.errors}/{seen.calls} calls{speed}"

    def _become(
        self, state: HealthState, reason: str, *, cause: str = "", healthy_since: float | None = None
    ) -> GeneratorHealth:
        hb, seen, prev = self.hb, self.seen, self.prev
        return GeneratorHealth(
            worker_id=self.gid,
            state=state,
            reason=reason,
            since=prev.since if prev is not None and prev.state == state else self.now,
            heartbeat_state=hb.state if hb else "",
            started_at=hb.started_at if hb else prev.started_at if prev else 0.0,
            calls=seen.calls,
            errors=seen.errors,
            connection_errors=seen.connection_errors,
            latency_calls=seen.latency_calls,
            latency_per_token_s=seen.latency_median_s,
            latency_factor=self.factor,
            cause=cause,
            healthy_since=healthy_since,
        )


# -- Redis ------------------------------------------------------------------------------------


async def publish_calls(redis: aioredis.Redis, keys: K.RunKeys, summaries: Sequence[CallSummary]) -> None:
    """One gateway's summaries, one field per (gateway, generator)."""
    if summaries:
        await redis.hset(keys.generator_calls, mapping={f"{s.gateway_id}|{s.worker_id}": encode(s) for s in summaries})


async def fleet_health(
    redis: aioredis.Redis,
    keys: K.RunKeys,
    *,
    now: float | None = None,
    policy: HealthPolicy = DEFAULT_POLICY,
    heartbeats: Sequence[Heartbeat] | None = None,
    record: bool = True,
) -> dict[str, GeneratorHealth]:
    """Every known generator's health, by worker id (`assess_fleet` over Redis). ``heartbeats``:
    the caller's fresh registry read, if it has one (else read here, without purging).
    ``record``: write the verdicts back as the fleet's memory and delete summaries and verdicts
    nobody needs any more; False for a reader that must not write (it still reads the memory)."""
    now = time.time() if now is None else now
    if heartbeats is None:
        heartbeats = [v.heartbeat for v in await worker_views(redis, keys) if v.heartbeat.kind == "generator"]
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.generator_calls)
        pipe.hgetall(keys.generator_health)
        raw_calls, raw_health = await pipe.execute()
    calls = _decode_fields(raw_calls, CallSummary)
    previous = {h.worker_id: h for h in _decode_fields(raw_health, GeneratorHealth).values()}
    out = assess_fleet(heartbeats, calls.values(), now=now, policy=policy, previous=previous)
    if record:
        stale = [f for f, s in calls.items() if s.window_end < now - 2 * policy.window_s]
        await _remember(redis, keys, previous, out, stale)
    return out


async def _remember(
    redis: aioredis.Redis,
    keys: K.RunKeys,
    previous: Mapping[str, GeneratorHealth],
    out: Mapping[str, GeneratorHealth],
    stale_calls: list[str],
) -> None:
    """Write the verdicts whose memory changed (state, since, recovery, process); forget the rest."""

    def memory(h: GeneratorHealth) -> tuple[object, ...]:
        return h.state, h.since, h.healthy_since, h.cause, h.started_at, h.heartbeat_state

    changed = [g for g, h in out.items() if g not in previous or memory(previous[g]) != memory(h)]
    gone = [g for g in previous if g not in out]
    if not (changed or gone or stale_calls):
        return
    async with redis.pipeline(transaction=False) as pipe:
        if changed:
            pipe.hset(keys.generator_health, mapping={g: encode(out[g]) for g in changed})
        if gone:
            pipe.hdel(keys.generator_health, *gone)
        if stale_calls:
            pipe.hdel(keys.generator_calls, *stale_calls)
        await pipe.execute()


def _decode_fields(raw: Mapping[bytes | str, bytes | str], cls: type[M]) -> dict[str, M]:
    out: dict[str, M] = {}
    for field, data in raw.items():
        name = field.decode() if isinstance(field, bytes) else field
        try:
            out[name] = decode(as_bytes(data), cls)
        except ProtocolError as exc:  # another version's writer, or garbage: skipped, said once
            log.warning("unreadable %s field %r: %s", cls.__name__, name, exc)
    return out

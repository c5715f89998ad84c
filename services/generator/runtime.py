"""The generator's live state: lifecycle, weight version, admission of requests, pauses, counters.

One Runtime per process, on ``app.state.runtime``; routes admit requests through it, the refit
(`services.generator.weights`) and the admin routes pause and resume through it, the heartbeat
and /admin/state read it.

Lifecycle (``state``)::

    starting --engine up, initial weights loaded--> ready <--resume-- paused (admin pause)
    starting --engine up on random weights (load_format dummy), nothing to load yet--> awaiting_weights
             --the first refit or snapshot--> loading --ok--> ready     (503 for generation until then)
                                                    ready --refit--> loading --ok--> ready
    any --failed load / failed cache reset / engine died--> failed      (503 for generation)
    any --a background task died (bring-up, weight watcher)--> failed, and the service exits 1
    any --SIGTERM--> draining      (503 for new sessions; sessions already here are still served)

Admission: a request waits while the gate is closed (a pause or a refit is under way), then for
one of ``generator.max_concurrent_requests`` slots; the weight version is read when it is
admitted. Pauses are kept per reason (`LocalPause`: admin, refit), so ending one does not end the
other; the engine resumes when no reason is left.

Draining (scale-down, SIGTERM): the registry shows "draining", so gateways stop routing new
sessions here; a request of a session this generator has already served is still admitted (a
multi-turn rollout finishes where its prefix cache is), any other gets 503 and its gateway fails
over. `drain_sessions` returns once nothing is in flight and no call came for
``generator.drain_session_idle_s``, or at ``generator.drain_timeout_s``; then the server stops.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.generator.engine import Engine, PauseMode
from shared.http import HTTPError
from shared.protocol import WorkerState

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0
# Sessions are remembered this long after their last call (to keep serving them while draining).
_SESSION_MEMORY_S = 600.0
_SESSION_PRUNE_EVERY = 1024


class LocalPause(enum.StrEnum):
    """Why this generator's engine is paused. Local to one generator, unlike the run-wide
    `shared.pause.PauseReason` the trainer records in Redis (its refit reaches generators as a
    weight announcement, which `services.generator.weights` applies under REFIT)."""

    ADMIN = "admin"  # POST /admin/pause, until POST /admin/resume
    REFIT = "refit"  # a weight load, until it finished (state "loading")


@dataclass(frozen=True)
class Ticket:
    """An admitted request: the weight version it started under."""

    weight_version: int
    admitted_at: float


class Runtime:
    def __init__(self, engine: Engine, worker_id: str, *, max_concurrent_requests: int, drain_timeout_s: float) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.drain_timeout_s = drain_timeout_s
        self.weight_version = -1
        self.weight_checksum: str | None = None  # of the folder the served version came from
        self.awaiting_weights = False  # the engine holds random weights until a version loads
        self.error: str | None = None
        self.started = False
        self.draining = False
        self.in_flight = 0
        self.waiting = 0
        self.requests_total = 0
        self.prefix_cache_resets = 0
        self.interrupts = 0  # refits that interrupted running generations (to be continued)
        self.last_refit_s = 0.0
        self._gate = asyncio.Event()
        self._gate.set()
        self._slots = asyncio.Semaphore(max_concurrent_requests)
        self._pause_reasons: set[LocalPause] = set()
        self._pause_lock = asyncio.Lock()
        self._tokens: deque[tuple[float, int]] = deque()
        self._sessions: dict[str, float] = {}  # session id -> last admission (monotonic)
        self.last_activity = 0.0  # monotonic time a request was last admitted or finished

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def state(self) -> WorkerState:
        if self.error is not None or self.engine.errored:
            return "failed"
        if self.draining:
            return "draining"
        if not self.started:
            return "starting"
        if LocalPause.REFIT in self._pause_reasons:
            return "loading"
        if self.awaiting_weights:
            return "awaiting_weights"
        if self._pause_reasons:
            return "paused"
        return "ready"

    @property
    def ready(self) -> bool:
        return self.state in ("ready", "paused", "loading", "awaiting_weights")

    def fail(self, error: str) -> None:
        """Mark the generator failed; generation answers 503 until a later load succeeds (called
        for a failed load, an engine that died, and by the app when the service itself failed)."""
        log.error("generator failed: %s", error)
        self.error = error

    def check_not_failed(self) -> None:
        if self.state == "failed":
            err = self.error or "the engine died"
            raise HTTPError(503, f"generator {self.worker_id} failed: {err}", type_="service_unavailable")

    def check_serving(self, session_id: str | None = None) -> None:
        """503 unless a request of ``session_id`` may be admitted (while draining: only a session
        this generator has served)."""
        self.check_not_failed()
        state = self.state
        if state == "starting" or (state == "draining" and session_id not in self._sessions):
            raise HTTPError(503, f"generator {self.worker_id} is {state}", type_="service_unavailable")
        if state == "awaiting_weights":
            raise HTTPError(
                503,
                f"generator {self.worker_id} holds no weights yet (it started on random ones, "
                "policy.generation.vllm_cfg.load_format dummy): it serves once a weight version reaches it",
                type_="service_unavailable",
            )

    def _note_session(self, session_id: str | None) -> None:
        now = time.monotonic()
        self.last_activity = now
        if session_id is None:
            return
        self._sessions[session_id] = now
        if len(self._sessions) % _SESSION_PRUNE_EVERY == 0:
            self._sessions = {k: t for k, t in self._sessions.items() if now - t < _SESSION_MEMORY_S}

    async def drain_sessions(self, idle_s: float, timeout_s: float) -> bool:
        """Stop taking new sessions and keep serving the ones here until nothing is in flight or
        waiting and no call came for ``idle_s``; at most ``timeout_s``. True if it went quiet."""
        self.draining = True
        t0 = time.monotonic()
        log.info(
            "draining: serving the sessions already here until %.1fs pass without a call (at most %.0fs)",
            idle_s,
            timeout_s,
        )
        while time.monotonic() - t0 < timeout_s:
            if not self.in_flight and not self.waiting and time.monotonic() - self.last_activity >= idle_s:
                log.info("drained in %.1fs after %d request(s)", time.monotonic() - t0, self.requests_total)
                return True
            await asyncio.sleep(0.05)
        log.warning(
            "drain deadline (generator.drain_timeout_s = %.0fs) passed with %d request(s) in flight",
            timeout_s,
            self.in_flight,
        )
        return False

    # -- admission -----------------------------------------------------------------------------

    @asynccontextmanager
    async def admission(self, session_id: str | None = None) -> AsyncIterator[Ticket]:
        """Hold one request slot while the body runs; 503 when not serving."""
        self.check_serving(session_id)
        self.waiting += 1
        try:
            while True:
                await self._gate.wait()
                await self._slots.acquire()
                if self._gate.is_set():
                    break
                self._slots.release()  # a pause began while we waited for the slot
        finally:
            self.waiting -= 1
        self.in_flight += 1
        self.requests_total += 1
        try:
            self.check_serving(session_id)
            self._note_session(session_id)
            yield Ticket(weight_version=self.weight_version, admitted_at=time.monotonic())
        finally:
            self.in_flight -= 1
            self.last_activity = time.monotonic()
            self._slots.release()

    def record_tokens(self, n: int) -> None:
        now = time.monotonic()
        self._tokens.append((now, n))
        self._trim(now)

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        self._trim(now)
        return sum(n for _, n in self._tokens) / _RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._tokens and self._tokens[0][0] < now - _RATE_WINDOW_S:
            self._tokens.popleft()

    # -- pause / resume ------------------------------------------------------------------------

    @property
    def pause_reasons(self) -> frozenset[LocalPause]:
        return frozenset(self._pause_reasons)

    async def pause(self, reason: LocalPause, mode: PauseMode) -> None:
        """Close the gate and pause the engine. ``drain`` waits up to drain_timeout_s for
        in-flight requests, then stops the rest; ``keep`` stops them at once. Stopping means
        freezing them, except for a refit: the weights change under them, so they are
        interrupted and continued on the new weights (`services.generator.partial`)."""
        stop: PauseMode = "interrupt" if reason == LocalPause.REFIT else "keep"
        async with self._pause_lock:
            self._pause_reasons.add(reason)
            self._gate.clear()
            if mode != "drain":
                await self._stop_running(stop)
                return
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(self.drain_timeout_s):
                    await self.engine.pause("drain")
                log.info("drained for %s in %.2fs", reason, time.monotonic() - t0)
            except TimeoutError:
                log.warning(
                    "drain for %s timed out after %.0fs (generator.drain_timeout_s) with %d request(s) in "
                    "flight; freezing them instead",
                    reason,
                    self.drain_timeout_s,
                    self.in_flight,
                )
                await self._stop_running(stop)

    async def _stop_running(self, mode: PauseMode) -> None:
        if mode == "interrupt":
            self.interrupts += 1  # before the engine ends them: their callers check it
        await self.engine.pause(mode)

    async def reopened(self, session_id: str | None = None) -> int:
        """Wait until no pause holds the gate (an admitted request continuing after a refit);
        the weight version then served. Raises like admission when the generator stopped serving."""
        await self._gate.wait()
        self.check_serving(session_id)
        return self.weight_version

    async def resume(self, reason: LocalPause) -> bool:
        """End the pause for ``reason``; True when nothing else holds the engine paused."""
        async with self._pause_lock:
            self._pause_reasons.discard(reason)
            if self._pause_reasons:
                return False
            await self.engine.resume()
            self._gate.set()
            return True

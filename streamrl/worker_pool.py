"""The generator and gateway processes of a ``streamrl up`` job, scaled while it runs.

One `WorkerPool` per service; the supervisor calls `tick` every loop turn::

    member:  STARTING --GET /ready 200--> READY --scale down--> STOPPING --exits--> gone
                 |  (dies or not ready in time: the scale request fails)      --stop_timeout_s--> SIGKILL
             READY --dies--> (the supervisor's restart budget allows) STARTING again after a backoff
    tick:    poll STARTING and STOPPING members, then move toward the target: start new members
             (next index, a new port) or stop the newest ones first (SIGTERM: they drain)

`ScaleChannel` is the control channel from ``streamrl scale`` (`streamrl.scale_local`): the
wanted counts are a ScaleRequest under the run's ``scale:request`` key, which the supervisor reads
every turn; it answers with a ScaleStatus under ``scale:status``. A Redis key rather than an HTTP
endpoint on the supervisor because the supervisor is one synchronous loop that already ticks: a
key needs no server thread, no extra port and no new authentication (the run's Redis URL carries
its password or ACL user), and it holds the wanted state, so the latest request wins and a CLI
that goes away loses nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import httpx
import redis

from shared import keys as K
from shared.protocol import ProtocolError, ScaleRequest, ScaleStatus, decode, encode
from shared.redis_replies import as_bytes
from streamrl.scale import SERVICES

if TYPE_CHECKING:
    from streamrl.supervisor import Child

log = logging.getLogger(__name__)


class CannotStart(RuntimeError):
    """A member that cannot be started now (no free device slot): the scale request fails."""


@dataclass
class Member:
    child: Child
    state: Literal["starting", "ready", "stopping"]
    since: float
    stop_deadline: float = 0.0
    restart_at: float | None = None  # died: started again (same name, port, worker id) at this time
    restarted: bool = False  # started again after a crash: dying while starting is a crash too


class WorkerPool:
    """The processes of one service. ``make_child(index)`` builds (does not start) member ``index``."""

    def __init__(
        self, service: str, make_child: Callable[[int], Child], *, stop_timeout_s: float, ready_timeout_s: float
    ) -> None:
        self.service = service
        self.make_child = make_child
        self.stop_timeout_s = stop_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.members: list[Member] = []
        self.target = 0
        self.next_index = 0
        self.error: str | None = None  # why the latest scale-up failed

    def counts(self) -> dict[str, int]:
        return {s: sum(m.state == s for m in self.members) for s in ("starting", "ready", "stopping")}

    def children(self) -> list[Child]:
        return [m.child for m in self.members]

    def start_initial(self, n: int) -> list[Child]:
        """Start ``n`` members at job start-up (the supervisor waits for them itself)."""
        self.target = n
        return [self._start().child for _ in range(n)]

    def mark_ready(self) -> None:
        for m in self.members:
            if m.state == "starting":
                m.state = "ready"

    def crashed(self) -> list[Member]:
        """Members that died on their own: ready ones, and restarted ones that died again while
        starting. Exit code 0 or SIGTERM is a worker leaving because the run ended."""
        return [
            m
            for m in self.members
            if m.restart_at is None
            and (m.state == "ready" or (m.state == "starting" and m.restarted))
            and not m.child.alive()
            and m.child.returncode not in (0, -15)
        ]

    def restart_later(self, m: Member, at: float) -> None:
        """Start the dead member ``m`` again at ``at`` (same name, port and worker id: a gateway
        worker then re-reads its own pending tasks)."""
        m.state, m.restart_at, m.restarted = "starting", at, True

    def _poll_restarts(self, now: float) -> bool:
        due = [m for m in self.members if m.restart_at is not None and m.restart_at <= now]
        for m in due:
            m.restart_at, m.since = None, now
            m.child.start()
            log.warning("%s: restarted %s (pid %d)", self.service, m.child.name, m.child.pid)
        return bool(due)

    def tick(self, now: float) -> bool:
        """Poll members and move toward the target; True when membership changed."""
        changed = self._poll_restarts(now) | self._poll_starting(now) | self._poll_stopping(now)
        live = [m for m in self.members if m.state != "stopping"]
        if len(live) < self.target and self.error is None:
            for _ in range(self.target - len(live)):
                try:
                    self._start()
                except CannotStart as exc:
                    log.error("%s: %s", self.service, exc)
                    self.error = str(exc)
                    break
            changed = True
        elif len(live) > self.target:
            # Newest first: starting members before ready ones, the highest index first.
            for m in sorted(live, key=lambda m: (m.state == "starting", m.since), reverse=True)[
                : len(live) - self.target
            ]:
                self._stop(m, now)
            changed = True
        return changed

    def _start(self) -> Member:
        child = self.make_child(self.next_index)
        self.next_index += 1
        child.start()
        m = Member(child, "starting", time.monotonic())
        self.members.append(m)
        log.info("%s: started %s (pid %d) at %s", self.service, child.name, child.pid, child.url)
        return m

    def _stop(self, m: Member, now: float) -> None:
        m.state, m.stop_deadline = "stopping", now + self.stop_timeout_s
        m.child.terminate()
        log.info(
            "%s: stopping %s (SIGTERM; it drains, killed after %.0fs)", self.service, m.child.name, self.stop_timeout_s
        )

    def _poll_starting(self, now: float) -> bool:
        changed = False
        for m in [m for m in self.members if m.state == "starting"]:
            if m.restart_at is not None or (m.restarted and not m.child.alive()):
                continue  # waiting for its restart, or died again: the supervisor decides (crashed)
            if not m.child.alive():
                self._fail(m, f"{m.child.name} exited while starting (code {m.child.returncode}):\n{m.child.tail()}")
            elif _answers_ready(m.child.url):
                m.state = "ready"
                log.info("%s: %s is ready after %.1fs", self.service, m.child.name, now - m.since)
            elif now - m.since > self.ready_timeout_s:
                self._fail(m, f"{m.child.name} not ready within {self.ready_timeout_s:.0f}s:\n{m.child.tail()}")
                self._stop(m, now)
                continue
            else:
                continue
            changed = True
        return changed

    def _fail(self, m: Member, error: str) -> None:
        log.error("%s: %s", self.service, error)
        self.error = error
        if not m.child.alive():
            self.members.remove(m)

    def _poll_stopping(self, now: float) -> bool:
        changed = False
        for m in [m for m in self.members if m.state == "stopping"]:
            if m.child.alive() and now > m.stop_deadline:
                log.warning(
                    "%s: %s did not stop within %.0fs; killing it", self.service, m.child.name, self.stop_timeout_s
                )
                m.child.kill()
            if not m.child.alive():
                self.members.remove(m)
                log.info("%s: %s stopped (code %s)", self.service, m.child.name, m.child.returncode)
                changed = True
        return changed


def _answers_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class ScaleChannel:
    """The supervisor's end of the scale control channel (the CLI's end: `streamrl.scale_local`)."""

    def __init__(self, client: redis.Redis, run_keys: K.RunKeys, pools: dict[str, WorkerPool]) -> None:
        self.redis = client
        self.keys = run_keys
        self.pools = pools
        self.request_id = "up"  # the start-up counts answer as if requested
        self.request_error: str | None = None
        self._published: ScaleStatus | None = None
        # A request left by an earlier job of this run id (a resume) is not this job's: the config
        # decides the start-up counts.
        self.redis.delete(self.keys.scale_request)

    def tick(self) -> bool:
        """Take a new request, move every pool, publish the status; True when membership changed."""
        self._take_request()
        now = time.monotonic()
        changed = False
        for pool in self.pools.values():
            changed |= pool.tick(now)
        self._publish()
        return changed

    def _take_request(self) -> None:
        raw = self.redis.get(self.keys.scale_request)
        if raw is None:
            return
        try:
            req = decode(as_bytes(raw), ScaleRequest)
        except ProtocolError as exc:
            log.error("ignoring an unreadable scale request: %s", exc)
            self.redis.delete(self.keys.scale_request)
            return
        if req.request_id == self.request_id:
            return
        self.request_id, self.request_error = req.request_id, None
        bad = [f"{s}={n}" for s, n in req.targets.items() if s not in self.pools or n < 1]
        if bad:
            self.request_error = f"cannot scale {', '.join(bad)}: services are {', '.join(SERVICES)}, counts >= 1"
            log.error("scale request %s: %s", req.request_id, self.request_error)
            return
        for service, n in req.targets.items():
            pool = self.pools[service]
            pool.target, pool.error = n, None
            log.info("scale request %s: %s -> %d", req.request_id, service, n)

    def status(self) -> ScaleStatus:
        counts = {s: p.counts() for s, p in self.pools.items()}
        error = self.request_error or next((p.error for p in self.pools.values() if p.error), None)
        settled = all(
            c["starting"] == 0 and c["stopping"] == 0 and c["ready"] == p.target
            for c, p in zip(counts.values(), self.pools.values(), strict=True)
        )
        phase: Literal["scaling", "done", "failed"] = "failed" if error else "done" if settled else "scaling"
        return ScaleStatus(
            request_id=self.request_id,
            phase=phase,
            error=error,
            ready={s: c["ready"] for s, c in counts.items()},
            starting={s: c["starting"] for s, c in counts.items()},
            stopping={s: c["stopping"] for s, c in counts.items()},
        )

    def _publish(self) -> None:
        st = self.status()
        last = self._published
        if last is not None and (last.request_id, last.phase, last.ready, last.starting, last.stopping, last.error) == (
            st.request_id,
            st.phase,
            st.ready,
            st.starting,
            st.stopping,
            st.error,
        ):
            return
        self.redis.set(self.keys.scale_status, encode(st))
        self._published = st

"""The gateway's sliding window of model calls per generator: what `shared.fleet_health` judges.

The session proxy records every call to a generator as it ends: ok with its latency per
generated token (per call when it generated none; none when the answer spans a refit, whose
latency is the refit's), or an error (HTTP 5xx, connection refused or dropped, timeout). A 4xx
is the agent's request refused, not the generator's fault: not recorded. The generator pool
(`services.gym_gateway.pool`) publishes `summaries` every ``HealthPolicy.publish_s``.

    proxy --ok(latency) / error(kind)--> deque per generator (last window_s, at most max_calls)
          --summaries()--> CallSummary per generator --pool--> Redis generators:calls
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping
from typing import Literal

from shared.fleet_health import CallSummary

ErrorKind = Literal["http", "connection", "timeout"]
_OK = "ok"


class CallWindow:
    """Calls per generator in the last ``window_s``, at most ``max_calls`` each (the newest)."""

    def __init__(self, window_s: float = 60.0, max_calls: int = 512) -> None:
        self.window_s = window_s
        self.max_calls = max_calls
        # generator id -> (monotonic time, outcome, latency per token or None)
        self._calls: dict[str, deque[tuple[float, str, float | None]]] = {}

    def ok(self, generator_id: str, latency_s: float, tokens: int, *, timed: bool = True) -> None:
        """A call answered; ``timed`` False when its latency says nothing of the generator's speed."""
        per_token = latency_s / max(1, tokens) if timed else None
        self._window(generator_id).append((time.monotonic(), _OK, per_token))

    def error(self, generator_id: str, kind: ErrorKind) -> None:
        self._window(generator_id).append((time.monotonic(), kind, None))

    def forget(self, generator_id: str) -> None:
        """Drop a generator's calls (its process restarted: the old one's calls say nothing)."""
        self._calls.pop(generator_id, None)

    def _window(self, generator_id: str) -> deque[tuple[float, str, float | None]]:
        w = self._calls.get(generator_id)
        if w is None:
            w = self._calls[generator_id] = deque(maxlen=self.max_calls)
        return w

    def summaries(self, gateway_id: str, states: Mapping[str, str]) -> list[CallSummary]:
        """One summary per generator called in the window (emptied windows are dropped);
        ``states``: the last registry state this gateway saw of each generator."""
        mono, wall = time.monotonic(), time.time()
        out = []
        for gid, w in list(self._calls.items()):
            while w and w[0][0] < mono - self.window_s:
                w.popleft()
            if not w:
                del self._calls[gid]
                continue
            latencies = [lat for _, outcome, lat in w if lat is not None]
            out.append(
                CallSummary(
                    gateway_id=gateway_id,
                    worker_id=gid,
                    calls=len(w),
                    errors=sum(1 for _, outcome, _ in w if outcome != _OK),
                    connection_errors=sum(1 for _, outcome, _ in w if outcome == "connection"),
                    timeouts=sum(1 for _, outcome, _ in w if outcome == "timeout"),
                    latency_calls=len(latencies),
                    latency_sum_s=sum(latencies),
                    latency_median_s=statistics.median(latencies) if latencies else None,
                    window_start=wall - (mono - w[0][0]),
                    window_end=wall,
                    heartbeat_state=states.get(gid, ""),
                )
            )
        return out

"""Prometheus metrics for a service: its own registry, the text exposition, event-loop lag.

Each service builds one ServiceMetrics, declares its counters/gauges on ``registry`` and serves
``render()`` at ``GET /metrics``. Every service that reads streams also registers
`count_dead_letters`: ``streamrl_stream_deadlettered_total{stream}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.tasks import cancel_and_wait

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServiceMetrics:
    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.loop_lag = Gauge(
            "streamrl_event_loop_lag_seconds", "Delay of a 0.25 s timer on the event loop", registry=self.registry
        )
        self.up_since = Gauge("streamrl_start_time_seconds", "Unix time the service started", registry=self.registry)
        self.up_since.set(time.time())
        self._task: asyncio.Task[None] | None = None

    def count_dead_letters(self, client: Callable[[], Any]) -> None:
        """Serve the dead-letter counts of the `shared.streams.StreamClient` that ``client()``
        returns (None while the service has none yet)."""
        self.registry.register(DeadLetterCounts(client))

    def start_loop_lag_probe(self, interval_s: float = 0.25) -> None:
        async def probe() -> None:
            loop = asyncio.get_running_loop()
            while True:
                t0 = loop.time()
                await asyncio.sleep(interval_s)
                self.loop_lag.set(max(0.0, loop.time() - t0 - interval_s))

        self._task = asyncio.create_task(probe(), name="loop-lag-probe")

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], timeout_s=5.0, grace_s=0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class DeadLetterCounts(Collector):
    """Entries a service dead-lettered, per stream, read from its StreamClient at scrape time."""

    def __init__(self, client: Callable[[], Any]) -> None:
        self._client = client

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "streamrl_stream_deadlettered",
            "Stream entries this service dead-lettered (malformed, truncated, oversized, other schema version)",
            labels=["stream"],
        )
        client = self._client()
        for name, n in sorted(dict(getattr(client, "deadlettered_by_stream", None) or {}).items()):
            family.add_metric([name], float(n))
        yield family

"""Rollout outcomes of a gateway worker as Prometheus counters, read from the worker at scrape time.

    streamrl_gateway_rollouts_published_total            trajectories published (ok or failed)
    streamrl_gateway_rollouts_failed_total{reason}       failed rollouts by reason (timeout, transport, ...)
    streamrl_gateway_rollouts_retried_total{reason}      attempts run again by reason

The worker keeps plain counts (``completed``, ``failed`` and ``retried`` dicts of reason -> count);
this collector turns them into counter-typed series, so ``rate()`` works on them. Registered on the
gateway's registry by `services.gym_gateway.app`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class RolloutOutcomes(Collector):
    def __init__(self, worker: Callable[[], Any]) -> None:
        self._worker = worker  # the app's worker exists only while its lifespan runs

    def collect(self) -> Iterator[CounterMetricFamily]:
        worker = self._worker()
        published = CounterMetricFamily(
            "streamrl_gateway_rollouts_published", "Trajectories published by this worker (ok or failed)"
        )
        failed = CounterMetricFamily("streamrl_gateway_rollouts_failed", "Failed rollouts by reason", labels=["reason"])
        retried = CounterMetricFamily(
            "streamrl_gateway_rollouts_retried", "Rollout attempts run again by reason", labels=["reason"]
        )
        if worker is not None:
            published.add_metric([], float(worker.completed))
            for reason, n in sorted(dict(worker.failed).items()):
                failed.add_metric([reason], float(n))
            for reason, n in sorted(dict(getattr(worker, "retried", {})).items()):
                retried.add_metric([reason], float(n))
        yield from (published, failed, retried)

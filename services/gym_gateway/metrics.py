"""The gym gateway's Prometheus metrics (``GET /metrics``), read from its worker at scrape time.

    streamrl_gateway_active_rollouts                     rollouts running
    streamrl_gateway_model_calls_total                   model calls through the session proxy
    streamrl_gateway_prefix_breaks_total{env}            calls whose prompt broke the session's prefix
    streamrl_gateway_failovers_total                     session moves off a dead generator
    streamrl_gateway_released_tasks_total                tasks handed back to the group on drain
    streamrl_gateway_rollouts_published_total            trajectories published (ok or failed)
    streamrl_gateway_rollouts_failed_total{reason}       failed rollouts by reason (timeout, transport, ...)
    streamrl_gateway_rollouts_retried_total{reason}      attempts run again by reason
    streamrl_gateway_tool_call_errors_total{reason}      tool calls the model wrote that cannot be used
    streamrl_gateway_external_waiting                    external tasks waiting for an agent to claim them
    streamrl_gateway_generator_health{generator,state}   1 for each generator's health state (`shared.fleet_health`)
    streamrl_stream_deadlettered_total{stream}, streamrl_event_loop_lag_seconds, ...  (`shared.metrics`)

The worker and the proxy keep plain counts; `GatewayMetrics.render` copies them into the gauges and
`RolloutOutcomes` turns the worker's per-reason dicts into counter-typed series (so ``rate()``
works on them). Built by `services.gym_gateway.app.build_app` with a getter of the worker, which
the app's lifespan creates before any scrape can arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.metrics import ServiceMetrics

if TYPE_CHECKING:
    from services.gym_gateway.worker import GatewayWorker


class RolloutOutcomes(Collector):
    def __init__(self, worker: Callable[[], GatewayWorker]) -> None:
        self._worker = worker

    def collect(self) -> Iterator[CounterMetricFamily]:
        worker = self._worker()
        published = CounterMetricFamily(
            "streamrl_gateway_rollouts_published", "Trajectories published by this worker (ok or failed)"
        )
        failed = CounterMetricFamily("streamrl_gateway_rollouts_failed", "Failed rollouts by reason", labels=["reason"])
        retried = CounterMetricFamily(
            "streamrl_gateway_rollouts_retried", "Rollout attempts run again by reason", labels=["reason"]
        )
        tool_call_errors = CounterMetricFamily(
            "streamrl_gateway_tool_call_errors",
            "Tool calls the model wrote that cannot be used, by reason (invalid_json, unknown_tool, ...)",
            labels=["reason"],
        )
        published.add_metric([], float(worker.completed))
        for reason, n in sorted(worker.failed.items()):
            failed.add_metric([reason], float(n))
        for reason, n in sorted(worker.retried.items()):
            retried.add_metric([reason], float(n))
        for reason, n in sorted(worker.proxy.tool_call_errors_by_reason.items()):
            tool_call_errors.add_metric([reason], float(n))
        yield from (published, failed, retried, tool_call_errors)


class GatewayMetrics(ServiceMetrics):
    def __init__(self, worker: Callable[[], GatewayWorker]) -> None:
        super().__init__("gym_gateway")
        self._worker = worker
        r = self.registry
        r.register(RolloutOutcomes(worker))
        self.count_dead_letters(lambda: worker().streams)
        self.active = Gauge("streamrl_gateway_active_rollouts", "Rollouts running", registry=r)
        self.calls = Gauge("streamrl_gateway_model_calls_total", "Model calls through the proxy", registry=r)
        self.prefix_breaks = Gauge(
            "streamrl_gateway_prefix_breaks_total",
            "Calls whose prompt broke the session's token prefix",
            ["env"],
            registry=r,
        )
        self.released = Gauge(
            "streamrl_gateway_released_tasks_total", "Tasks handed back to the group on drain", registry=r
        )
        self.failovers = Gauge("streamrl_gateway_failovers_total", "Session moves off a dead generator", registry=r)
        self.external_waiting = Gauge(
            "streamrl_gateway_external_waiting", "External tasks waiting for an agent to claim them", registry=r
        )
        self.generator_health = Gauge(
            "streamrl_gateway_generator_health",
            "1 for each generator's health state (serving, degraded, draining, lost) as this gateway last read it",
            ["generator", "state"],
            registry=r,
        )

    async def render_text(self) -> bytes:
        """The exposition, with the gauges set from the worker and its proxy first."""
        worker = self._worker()
        proxy = worker.proxy
        self.active.set(len(worker.active))
        self.calls.set(proxy.calls_total)
        for env, n in proxy.prefix_breaks_by_env.items():
            self.prefix_breaks.labels(env=env).set(n)
        self.failovers.set(proxy.failovers_total)
        self.released.set(worker.released)
        self.external_waiting.set(worker.external.waiting)
        self.generator_health.clear()  # a generator's old state, or a forgotten generator, is no series
        for gid, h in proxy.pool.health.items():
            self.generator_health.labels(generator=gid, state=h.state).set(1)
        return self.render()

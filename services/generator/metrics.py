"""The generator's Prometheus metrics, served at GET /metrics.

Counters are incremented by `services.generator.serving` (requests, tokens) and
`services.generator.weights` (refits, prefix cache resets); gauges read the Runtime when scraped,
so they are never stale. Event-loop lag comes from `shared.metrics.ServiceMetrics`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.generator.runtime import Runtime
from shared.metrics import ServiceMetrics

_REFIT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GeneratorMetrics(ServiceMetrics):
    def __init__(self, runtime: Runtime) -> None:
        super().__init__("generator")
        r = self.registry
        self.requests = Counter(
            "streamrl_generator_requests_total",
            "HTTP generation requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "streamrl_generator_prompt_tokens_total", "Prompt tokens fed to the engine", registry=r
        )
        self.generated_tokens = Counter("streamrl_generator_generated_tokens_total", "Tokens generated", registry=r)
        self.refit_seconds = Histogram(
            "streamrl_generator_refit_seconds",
            "Time from announcement to resumed serving",
            buckets=_REFIT_BUCKETS_S,
            registry=r,
        )
        self.refits = Counter("streamrl_generator_refits_total", "Weight loads by outcome", ["outcome"], registry=r)
        self.prefix_cache_resets = Counter(
            "streamrl_generator_prefix_cache_resets_total", "Successful prefix cache resets", registry=r
        )
        self.splices = Counter(
            "streamrl_generator_prefix_splices_total", "Prompts that kept the model's earlier tokens", registry=r
        )
        Gauge("streamrl_generator_in_flight", "Requests admitted and not finished", registry=r).set_function(
            lambda: runtime.in_flight
        )
        Gauge("streamrl_generator_waiting", "Requests waiting for admission (gate or slot)", registry=r).set_function(
            lambda: runtime.waiting
        )
        Gauge(
            "streamrl_generator_weight_version", "Weight version being served (-1: initial weights)", registry=r
        ).set_function(lambda: runtime.weight_version)
        Gauge("streamrl_generator_failed", "1 while the generator is failed", registry=r).set_function(
            lambda: 1.0 if runtime.state == "failed" else 0.0
        )
        Gauge(
            "streamrl_generator_tokens_per_second", "Generated tokens per second over the last 10 s", registry=r
        ).set_function(runtime.tokens_per_s)

"""The tracing section (``tracing``): OpenTelemetry traces across the services, one trace per
trajectory (task issued -> rollout -> model calls -> trajectory published -> consumed or evicted).
Off by default.

Read by every service at start (`shared.tracing.setup`, from each app's lifespan). `check_tracing`
holds the checks every service runs (`shared.run_config.RunConfig.check`), naming the key.
"""

from __future__ import annotations

from typing import Annotated

from shared.config_error import ConfigError
from shared.sections.base import D, Section


class TracingSection(Section):
    enabled: Annotated[
        bool, D("record OpenTelemetry spans: one trace per trajectory across trainer, gateway and generator")
    ] = False
    otlp_endpoint: Annotated[
        str | None,
        D(
            "base URL of an OTLP/HTTP collector (e.g. http://127.0.0.1:4318; spans go to <url>/v1/traces); "
            "null: env OTEL_EXPORTER_OTLP_ENDPOINT if set, else only the file"
        ),
    ] = None
    file: Annotated[
        str | None,
        D(
            "JSON-lines file of this process's spans (one object per span); null: "
            "<run.output_dir>/traces/<service>-<worker_id>.jsonl unless spans go to a collector"
        ),
    ] = None
    sample_ratio: Annotated[
        float, D("fraction of trajectories traced (decided where a trace starts; the other services follow it)")
    ] = 1.0


def check_tracing(t: TracingSection) -> None:
    """A ratio outside [0, 1], refused naming the key (also when tracing is off)."""
    if not 0.0 <= t.sample_ratio <= 1.0:
        raise ConfigError(f"tracing.sample_ratio must be in [0, 1], not {t.sample_ratio}")

"""OpenTelemetry traces across the services: one trace per trajectory.

    trainer   task.issued (root, one per Task) --traceparent on the Task--> gateway
    gateway   rollout (child of task.issued)
                model_call (the session proxy's POST, child of the rollout) --W3C headers--> generator
    generator   generate.chat / generate.completions (child of model_call: weight versions, token
                counts, worker id)
    gateway     trajectory.published (child of the rollout) --traceparent on the Trajectory--> trainer
    trainer   trajectory.consumed (the step that trains it) or trajectory.evicted (with the reason),
              children of trajectory.published

Each process calls `setup` once from its app's lifespan with the run's ``tracing`` section and
`shutdown` when it stops (the spans still queued are written). Off (the default), every helper
here returns at once without touching OpenTelemetry, which is not even imported: the hot paths
cost a branch. On, spans go through a BatchSpanProcessor to an OTLP/HTTP collector
(``tracing.otlp_endpoint``, or env OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) and/or a JSON-lines file per
process (`shared.trace_files`, default ``<run.output_dir>/traces/<service>-<worker_id>.jsonl``).
Sampling is parent-based: the trainer decides per trajectory (``tracing.sample_ratio``), the
gateway and the generator follow the ``traceparent`` they receive.

Helpers: spans (`span`, `active_span`, `start`/`end`), the W3C context on stream messages
(`stamp`, `context_of`: the Task's and the Trajectory's ``traceparent``/``tracestate``) and on HTTP
headers (`client_call` injects, `server_span` extracts). ``python -m shared.tracing tree FILE...``
prints the spans of trace files as trees (`shared.trace_files`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shared.sections.tracing import TracingSection

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from shared.protocol import Task, Trajectory

log = logging.getLogger(__name__)

SERVICE_NAMES = {
    "trainer": "streamrl-trainer",
    "gym_gateway": "streamrl-gym-gateway",
    "generator": "streamrl-generator",
}
WORKER_ID_ATTRIBUTE = "streamrl.worker_id"
Attributes = Mapping[str, Any]


class Traced(Protocol):
    """A stream message that carries its trajectory's trace context (Task, Trajectory)."""

    traceparent: str
    tracestate: str


class _State:
    tracer: Tracer | None = None  # None: tracing is off, every helper returns at once
    provider: TracerProvider | None = None
    propagator: Any = None  # W3C TraceContextTextMapPropagator
    context: Any = None  # the modules opentelemetry.context and opentelemetry.trace, once on
    trace: Any = None


_state = _State()


def enabled() -> bool:
    return _state.tracer is not None


def default_file(output_dir: str | Path, service: str, worker_id: str) -> Path:
    """``<output_dir>/traces/<service>-<worker_id>.jsonl`` (worker ids hold no "/")."""
    return Path(output_dir) / "traces" / f"{service}-{worker_id.replace('/', '_')}.jsonl"


def setup(section: TracingSection, *, service: str, worker_id: str, output_dir: str | Path) -> bool:
    """Start tracing for this process as ``service`` (a `shared.run_config.ServiceName`) when the
    section turns it on; True when it did. A second call replaces the first (tests start several
    services in one process)."""
    if not section.enabled:
        return False
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from shared.trace_files import JsonLinesSpanExporter

    shutdown()
    name = SERVICE_NAMES.get(service, f"streamrl-{service}")
    resource = Resource.create({"service.name": name, "service.instance.id": worker_id, WORKER_ID_ATTRIBUTE: worker_id})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(section.sample_ratio)))
    files: list[Path] = []
    env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    endpoint = section.otlp_endpoint or env
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint.rstrip("/") + "/v1/traces" if section.otlp_endpoint else None  # None: the env's, as given
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=1000))
    if section.file or not endpoint:
        path = Path(section.file) if section.file else default_file(output_dir, service, worker_id)
        files.append(path)
        provider.add_span_processor(
            BatchSpanProcessor(JsonLinesSpanExporter(path), max_queue_size=16384, schedule_delay_millis=1000)
        )
    _state.provider = provider
    _state.propagator = TraceContextTextMapPropagator()
    _state.context, _state.trace = otel_context, otel_trace
    _state.tracer = provider.get_tracer("streamrl")
    where = ", ".join([*(["OTLP " + endpoint] if endpoint else []), *map(str, files)])
    log.info("tracing on: %s %s, sample ratio %g, spans to %s", name, worker_id, section.sample_ratio, where)
    return True


def shutdown(timeout_s: float = 5.0) -> None:
    """Write the spans still queued and stop tracing (a no-op when it is off)."""
    provider, _state.provider, _state.tracer, _state.propagator = _state.provider, None, None, None
    if provider is None:
        return
    try:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()
    except Exception as exc:  # a collector gone must not fail a service's shutdown
        log.warning("tracing shutdown: %s", exc)


# ---- spans ------------------------------------------------------------------------------------


def start(
    name: str, parent: Context | None = None, attributes: Attributes | None = None, kind: str = "internal"
) -> Span | None:
    """A span started now (None when tracing is off); ``parent`` None starts a trace; ``kind``:
    internal, server or client (OpenTelemetry's SpanKind). End it with `end`."""
    tracer = _state.tracer
    if tracer is None:
        return None
    context = parent if parent is not None else _state.context.Context()
    return tracer.start_span(name, context=context, kind=_state.trace.SpanKind[kind.upper()], attributes=attributes)


def end(span: Span | None, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        trace = _state.trace
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def set_attributes(span: Span | None, attributes: Attributes) -> None:
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


@contextmanager
def _span(
    name: str, parent: Context | None, attributes: Attributes | None, current: bool, kind: str = "internal"
) -> Iterator[Span | None]:
    s = start(name, parent, attributes, kind)
    token = None
    if current and s is not None:
        token = _state.context.attach(_state.trace.set_span_in_context(s))
    try:
        yield s
    except BaseException as exc:
        end(s, exc)
        raise
    else:
        end(s)
    finally:
        if token is not None:
            _state.context.detach(token)


def span(
    name: str, parent: Context | None = None, attributes: Attributes | None = None
) -> AbstractContextManager[Span | None]:
    """A span around a block (an exception out of it marks the span failed); None when off."""
    return nullcontext() if _state.tracer is None else _span(name, parent, attributes, False)


def active_span(
    name: str, parent: Context | None = None, attributes: Attributes | None = None
) -> AbstractContextManager[Span | None]:
    """`span`, made the current one of this asyncio task meanwhile (`current` finds it)."""
    return nullcontext() if _state.tracer is None else _span(name, parent, attributes, True)


def current() -> Context | None:
    """The current context (its active span: the parent of spans started from it), None when off."""
    if _state.tracer is None:
        return None
    ctx: Context = _state.context.get_current()
    return ctx


def task_attributes(task: Task) -> dict[str, Any]:
    return {
        "streamrl.task_id": task.task_id,
        "streamrl.group_id": task.group_id,
        "streamrl.kind": task.kind,
        "streamrl.env": task.env,
        "streamrl.target_step": task.target_step,
        "streamrl.attempt": task.attempt,
    }


def trajectory_attributes(traj: Trajectory) -> dict[str, Any]:
    return {
        "streamrl.task_id": traj.task_id,
        "streamrl.status": traj.status,
        "streamrl.reward": traj.reward,
        "streamrl.launch_version": traj.launch_version,
        "streamrl.weight_versions": traj.versions,
        "streamrl.model_calls": len(traj.turns),
        "streamrl.generated_tokens": traj.num_generated_tokens,
        "streamrl.fallback_reason": traj.fallback_reason,
    }


# ---- context on stream messages and HTTP headers ------------------------------------------------


def _context(span_or_context: Span | Context) -> Context:
    if isinstance(span_or_context, dict):  # an OpenTelemetry Context is a dict
        return span_or_context
    ctx: Context = _state.trace.set_span_in_context(span_or_context)
    return ctx


def stamp(msg: Traced, span: Span | None) -> None:
    """Put ``span``'s W3C context on ``msg`` (its ``traceparent`` and ``tracestate``)."""
    if span is None or _state.propagator is None:
        return
    carrier: dict[str, str] = {}
    _state.propagator.inject(carrier, context=_context(span))
    msg.traceparent = carrier.get("traceparent", "")
    msg.tracestate = carrier.get("tracestate", "")


def context_of(msg: Traced) -> Context | None:
    """The context ``msg`` carries (the parent of what handles it); None when off or it has none."""
    if _state.propagator is None or not msg.traceparent:
        return None
    carrier = {"traceparent": msg.traceparent, "tracestate": msg.tracestate}
    ctx: Context = _state.propagator.extract(carrier)
    return ctx


def inject(headers: dict[str, str], span_or_context: Span | Context | None) -> dict[str, str]:
    """``headers`` with the W3C trace context (``traceparent``, ``tracestate``) of the span added."""
    if span_or_context is not None and _state.propagator is not None:
        _state.propagator.inject(headers, context=_context(span_or_context))
    return headers


def extract(headers: Mapping[str, str]) -> Context | None:
    """The W3C trace context an HTTP request's headers carry; None when off or they carry none."""
    if _state.propagator is None or "traceparent" not in headers:
        return None
    ctx: Context = _state.propagator.extract(headers)
    return ctx


@contextmanager
def _client_call(
    name: str, parent: Context | None, headers: Mapping[str, str], attributes: Attributes | None
) -> Iterator[Mapping[str, str]]:
    with _span(name, parent, attributes, False, "client") as s:
        yield inject(dict(headers), s)


def client_call(
    name: str, parent: Context | None, headers: Mapping[str, str], attributes: Attributes | None = None
) -> AbstractContextManager[Mapping[str, str]]:
    """A span around an outgoing HTTP call, child of ``parent``; yields ``headers`` with its context
    injected (``headers`` itself, untouched, when tracing is off)."""
    return nullcontext(headers) if _state.tracer is None else _client_call(name, parent, headers, attributes)


def server_span(
    name: str, headers: Mapping[str, str], attributes: Attributes | None = None
) -> AbstractContextManager[Span | None]:
    """A span around the handling of an HTTP request, child of the context its headers carry."""
    return nullcontext() if _state.tracer is None else _span(name, extract(headers), attributes, False, "server")


if __name__ == "__main__":
    from shared.trace_files import main

    sys.exit(main())

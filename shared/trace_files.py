"""Trace files: the JSON-lines span exporter of `shared.tracing`, and reading the files back.

One JSON object per span and line (`SpanRecord`): trace_id, span_id, parent_span_id (hex; null
for a trace's root), name, service, worker_id, start_ns, end_ns, status and attributes. Each
process appends to its own file (``<run.output_dir>/traces/<service>-<worker_id>.jsonl``), so a
restarted worker goes on in the same file. The exporter runs on the BatchSpanProcessor's thread.

``python -m shared.tracing tree FILE... [--trace ID] [--limit N]`` (or ``python -m
shared.trace_files``) prints the traces of the files as trees: span name, service, duration and
the main attributes, children under their parent in start order. Read by the end-to-end test
(tests/e2e/test_run_e2e.py) and the tracing benchmark (`streamrl.bench.tracing`).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# The attributes a tree line shows, when a span has them.
SHOWN = (
    "streamrl.task_id",
    "streamrl.step",
    "streamrl.eviction_reason",
    "streamrl.weight_versions",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "streamrl.status",
)


class SpanRecord(msgspec.Struct, kw_only=True):
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    worker_id: str
    start_ns: int
    end_ns: int
    status: str = "UNSET"
    attributes: dict[str, Any] = {}

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def span_record(span: ReadableSpan) -> SpanRecord:
    ctx, res = span.get_span_context(), span.resource.attributes
    assert ctx is not None
    return SpanRecord(
        trace_id=f"{ctx.trace_id:032x}",
        span_id=f"{ctx.span_id:016x}",
        parent_span_id=f"{span.parent.span_id:016x}" if span.parent is not None else None,
        name=span.name,
        service=str(res.get("service.name", "")),
        worker_id=str(res.get("service.instance.id", "")),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        status=span.status.status_code.name,
        attributes=dict(span.attributes or {}),  # sequences are tuples: JSON arrays all the same
    )


class JsonLinesSpanExporter(SpanExporter):
    """Appends one `SpanRecord` per finished span to ``path`` (created with its folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()
        self._file: IO[bytes] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = self._encoder.encode_lines([span_record(s) for s in spans])
        try:
            with self._lock:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = open(self.path, "ab")  # kept open until shutdown
                self._file.write(lines)
                self._file.flush()
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(paths: Iterable[Path]) -> list[SpanRecord]:
    """Every span of the trace files ``paths`` (a torn last line, from a process killed mid-write, skipped)."""
    decoder = msgspec.json.Decoder(SpanRecord)
    spans: list[SpanRecord] = []
    for path in paths:
        for line in Path(path).read_bytes().splitlines():
            try:
                spans.append(decoder.decode(line))
            except msgspec.DecodeError:
                continue
    return spans


def by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    traces: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    return dict(traces)


def tree_lines(spans: list[SpanRecord]) -> list[str]:
    """One trace as indented lines: a span's children under it, in start order. A span whose parent
    is not in the files (not written yet, or in a file not given) is shown as a root."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_span_id if s.parent_span_id in ids else None].append(s)
    t0 = min(s.start_ns for s in spans)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            shown = " ".join(f"{k.rsplit('.', 1)[-1]}={s.attributes[k]}" for k in SHOWN if k in s.attributes)
            lines.append(
                f"{'  ' * depth}{s.name} [{s.service}] +{(s.start_ns - t0) / 1e6:.1f}ms "
                f"{s.duration_ms:.1f}ms{' ' + shown if shown else ''}{' ERROR' if s.status == 'ERROR' else ''}"
            )
            walk(s.span_id, depth + 1)

    walk(None, 0)
    return lines


def main(argv: list[str] | None = None, out: IO[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.tracing", description="print the spans of trace files")
    sub = p.add_subparsers(dest="command", required=True)
    tree = sub.add_parser("tree", help="the traces of the files as trees of spans")
    tree.add_argument("files", nargs="+", type=Path, help="JSON-lines trace files (<output_dir>/traces/*.jsonl)")
    tree.add_argument("--trace", default=None, help="only this trace id")
    tree.add_argument("--limit", type=int, default=5, help="at most this many traces, the earliest first")
    args = p.parse_args(argv)
    out = out or sys.stdout
    traces = by_trace(read_spans(args.files))
    chosen = [args.trace] if args.trace else sorted(traces, key=lambda t: min(s.start_ns for s in traces[t]))
    for trace_id in chosen[: args.limit]:
        if trace_id not in traces:
            sys.stderr.write(f"no trace {trace_id} in the files\n")
            return 1
        out.write(f"trace {trace_id}\n")
        out.write("".join(f"  {line}\n" for line in tree_lines(traces[trace_id])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

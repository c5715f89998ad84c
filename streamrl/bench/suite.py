"""``streamrl bench``: runs the benchmark sections, stores their results and renders BENCHMARKS.md.

1. The demo run (`streamrl.bench.demo`, a fresh `streamrl demo`): per-step wall time split into
   waiting for data, training and refit; trajectories per second; reward first/last 5 steps.
2. Demo variants (`streamrl.bench.demo_variants`): short demo runs at top_p 0.9 (the trainer's
   mismatch figures with and without the nucleus truncation, from the same run) and with dynamic
   sampling, against the demo's own settings.
3. Stream transport (`streamrl.bench.streams`): trajectories through the real StreamClient with
   token arrays packed as int32/float32 bytes versus msgpack lists of numbers.
4. The generator (`streamrl.bench.generator`): HTTP layer against the raw vLLM engine in tokens/s,
   the cost of the prefix splice, and refit latency against a plain safetensors save + load.
5. The gym gateway (`streamrl.bench.gateway`): 256 concurrent multi-turn sessions through the
   session proxy against the same conversations sent straight to the generator; and the proxy
   alone at up to 4,096 sessions against a stand-in generator (`streamrl.bench.gateway_scale`).
6. OpenHands runners (`streamrl.bench.openhands`): warm runners against a fresh runner process
   per rollout, rollouts per minute and CPU seconds per rollout.
7. The trainer (`streamrl.bench.trainer`): the torch backend against a bare torch loop, two ranks
   against one, training state per rank, checkpoint saves, policy builds, the megatron backend.
8. Refit (`streamrl.bench.refit`): publish to confirmed, filesystem and collective transports,
   against raw baselines of the same bytes, and those costs scaled to a 397B-parameter run.
9. Pipeline efficiency (`streamrl.bench.pipeline`): the real trainer, buffer, streams and gateways
   with simulated rollout and training times against an ideal zero-overhead schedule; packing.
10. Beyond one host (`streamrl.bench.multihost`): the demo across simulated hosts, links shaped,
    against the same run on one host: step and refit time, bytes per link.
11. MoE routing replay (`streamrl.bench.routing_replay`): the trainer-vs-engine logprob mismatch
    at equal weights on the MoE demo's policy with replay off and on.
12. A run that sizes itself (`streamrl.bench.autoscale`): the autoscaled run against every fixed
    gateway count, with rollout times that double halfway through the run.
13. Tracing (`streamrl.bench.tracing`): what OpenTelemetry traces cost a step, off and on.

Every figure is reported against a baseline measured in the same run on the same machine, as a
ratio, or with its baseline named in its table. Each section's results are stored as
``<results>/<section>.json`` (`streamrl.bench.report`) and BENCHMARKS.md is rendered from every
stored section after each one is measured, so ``--only SECTION`` refreshes one section and leaves
the others as they were; ``--render`` only re-renders.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.bench import (
    autoscale,
    demo,
    demo_variants,
    gateway,
    gateway_scale,
    generator,
    multihost,
    openhands,
    refit,
    reshard,
    routing_replay,
    streams,
    tracing,
    trainer,
)
from streamrl.bench.pipeline_report import PipelineResults, render_pipeline
from streamrl.bench.refit_results import RefitResults
from streamrl.bench.report import Results, load, render, save
from streamrl.bench.trainer_results import TrainerResults

RESULTS = Path("benchmarks")
WORK = Path("runs/bench")
SUITE = "suite"  # the stored head of a whole run: its date and machine


class SuiteRun(Results):
    date: str
    machine: str


@dataclass(frozen=True)
class Section:
    """A section of BENCHMARKS.md: where its results are stored and how they are rendered."""

    name: str  # the JSON file's stem, the template's, ``--only NAME``'s
    results: type[Results]
    render: Callable[[Any], str]
    redis: bool = False  # measured against the suite's Valkey


# In the report's order.
REPORT = (
    Section("demo", demo.DemoResults, demo.render_section),
    Section("demo_variants", demo_variants.VariantsResults, demo_variants.render_section),
    Section("streams", streams.StreamsResults, streams.render_section, redis=True),
    Section("generator", generator.GeneratorResults, generator.render_section, redis=True),
    Section("gateway", gateway.GatewayResults, gateway.render_section, redis=True),
    Section("gateway_scale", gateway_scale.ScaleResults, gateway_scale.render_section),
    Section("openhands", openhands.OpenhandsResults, openhands.render_section),
    Section("trainer", TrainerResults, trainer.render_section),
    Section("refit", RefitResults, refit.render_section, redis=True),
    Section("reshard", reshard.ReshardResults, reshard.render_section, redis=True),
    Section("multihost", multihost.MultihostResults, multihost.render_section),
    Section("pipeline", PipelineResults, render_pipeline),
    Section("routing_replay", routing_replay.RoutingReplayResults, routing_replay.render_section),
    Section("autoscale", autoscale.AutoscaleResults, autoscale.render_section, redis=True),
    Section("tracing", tracing.TracingResults, tracing.render_section),
)
BY_NAME = {s.name: s for s in REPORT}
# Measurable alone (``--only``); the demo and the streams only in a whole run.
SECTIONS = (
    "generator",
    "gateway",
    "gateway_scale",
    "trainer",
    "pipeline",
    "refit",
    "reshard",
    "multihost",
    "demo_variants",
    "openhands",
    "routing_replay",
    "autoscale",
    "tracing",
)
# The order a whole run measures them in (the demo first, on a quiet machine).
MEASURED = (
    "demo",
    "demo_variants",
    "streams",
    "generator",
    "gateway",
    "refit",
    "reshard",
    "multihost",
    "trainer",
    "gateway_scale",
    "openhands",
    "pipeline",
    "routing_replay",
    "autoscale",
    "tracing",
)


def render_report(results_dir: Path) -> str:
    """BENCHMARKS.md from every section stored in ``results_dir``, in the report's order."""
    head_path = results_dir / f"{SUITE}.json"
    head = render("head", r=load(head_path, SuiteRun)) if head_path.is_file() else "# Benchmarks\n"
    parts = [head.rstrip("\n")]
    for section in REPORT:
        path = results_dir / f"{section.name}.json"
        if path.is_file():
            parts.append(section.render(load(path, section.results)).rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def write_report(results_dir: Path, out: Path) -> str:
    text = render_report(results_dir)
    out.write_text(text)
    return text


class _Valkey:
    """The suite's embedded Valkey, started for the first section that needs it."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.server: Any = None

    def url(self) -> str:
        from streamrl.redis_server import RedisServer

        if self.server is None:
            self.server = RedisServer(self.work / "redis", tied_to_parent=True)
            self.server.start()
        url: str = self.server.url
        return url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def measure(name: str, valkey: _Valkey, machine: str) -> tuple[Results, list[int]]:
    """Run section ``name``; its results and the exit codes of the runs it started (if any)."""
    work = WORK / name
    if name == "demo":
        code, results = demo.demo_benchmark(work)
        return results, [code]
    if name == "demo_variants":
        variants = demo_variants.demo_variants_benchmark(work, machine)
        return variants, [r.exit_code for r in variants.runs]
    if name == "pipeline":
        from streamrl.bench.pipeline import run_pipeline_benchmark  # the trainer's control plane: heavy

        return run_pipeline_benchmark(work), []
    measures: dict[str, Callable[[], Results]] = {
        "streams": lambda: streams.stream_benchmark(valkey.url()),
        "generator": lambda: generator.generator_benchmark(work, valkey.url(), machine),
        "gateway": lambda: gateway.gateway_benchmark(work, valkey.url(), machine),
        "refit": lambda: refit.refit_benchmark(work, valkey.url(), machine),
        "reshard": lambda: reshard.reshard_benchmark(work, valkey.url(), machine),
        "gateway_scale": lambda: gateway_scale.gateway_scale_benchmark(work, machine),
        "openhands": lambda: openhands.openhands_benchmark(work, machine),
        "trainer": lambda: trainer.trainer_benchmark(work, machine),
        "routing_replay": lambda: routing_replay.routing_replay_benchmark(work, machine),
        "multihost": lambda: multihost.multihost_benchmark(work, machine),
        "autoscale": lambda: autoscale.autoscale_benchmark(work, machine, valkey.url()),
        "tracing": lambda: tracing.tracing_benchmark(work, machine),
    }
    return measures[name](), []


def run_benchmarks(out: Path, only: str | None = None, results_dir: Path = RESULTS) -> int:
    """Every section (``only=None``) or the one named by ``only``: each stored in ``results_dir``
    as it is measured, and ``out`` rendered from every stored section after each. 1 when a run it
    started (the demo's) failed."""
    if only is not None and only not in SECTIONS:
        raise ValueError(f"unknown bench section {only!r}; one of: {', '.join(SECTIONS)}")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    names = MEASURED if only is None else (only,)
    valkey = _Valkey(WORK)
    codes: list[int] = []
    try:
        for i, name in enumerate(names):
            results, section_codes = measure(name, valkey, machine)
            codes += section_codes
            save(results_dir / f"{name}.json", results)
            if not any(BY_NAME[n].redis for n in names[i + 1 :]):
                valkey.stop()
            if only is None and i == len(names) - 1:
                save(results_dir / f"{SUITE}.json", SuiteRun(date=time.strftime("%Y-%m-%d"), machine=machine))
            text = write_report(results_dir, out)
    finally:
        valkey.stop()
    print(text)
    return 0 if all(c == 0 for c in codes) else 1

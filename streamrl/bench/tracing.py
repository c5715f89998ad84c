"""The tracing benchmark: what OpenTelemetry traces (`shared.tracing`) cost a training step, on and off.

A trajectory's traced paths run as the services run them, through the same helpers and messages:
the trainer's task.issued spans around a batch of Tasks encoded for the stream; per task the
gateway's decode, rollout span, ``calls`` model_call spans whose headers carry the context into the
generator's generate.chat span (weight versions and token counts set), the trajectory.published
span stamped on the encoded Trajectory; the trainer's decode and trajectory.consumed spans. The
same code runs with tracing off (every helper a no-op, OpenTelemetry not imported) and on (the
file exporter behind a BatchSpanProcessor, flushed inside the timed region). Figures are process
CPU time (the exporter's thread included), median of REPEATS rounds of TRAJECTORIES trajectories.

The cost per step is the difference per trajectory times the demo's trajectories per step
(``grpo.num_prompts_per_step x num_generations_per_prompt`` of deploy/configs/demo.yaml, at
``env.max_turns`` model calls each: the most a rollout makes), against the demo's median step time
(benchmarks/demo.json, measured by `streamrl.bench.demo`). All three services' shares are summed
as if one core did them all. Target: under 1% of the step. ``python -m streamrl.bench.tracing``
prints the section (templates/tracing.md.jinja); not yet part of the suite's report.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from services.trainer import tracing_spans
from services.trainer.buffer import Group, SampleResult
from shared import tracing
from shared.config import load as load_config
from shared.protocol import SamplingParams, Task, Trajectory, decode, encode, make_turn
from shared.run_config import RunConfig
from shared.sections.tracing import TracingSection
from streamrl.bench.demo import DemoResults
from streamrl.bench.report import Results, load, render, save

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "deploy" / "configs" / "demo.yaml"
DEMO_RESULTS = ROOT / "benchmarks" / "demo.json"
TRAJECTORIES = 2048
REPEATS = 5
TARGET_SHARE = 0.01
_HEADERS = {"content-type": "application/json"}
_GENERATED = {  # a generate.chat span's attributes (`services.generator.routes_openai`)
    "streamrl.worker_id": "generator-0",
    "streamrl.weight_version": 2,
    "streamrl.weight_version_end": 2,
    "streamrl.weight_versions": [2],
    "gen_ai.usage.input_tokens": 200,
    "gen_ai.usage.output_tokens": 32,
}


class TracingResults(Results):
    date: str
    machine: str
    trajectories: int  # per round
    calls_per_trajectory: int
    spans_per_trajectory: int
    off_us_per_trajectory: float  # CPU of the traced paths with tracing off (the work done anyway)
    on_us_per_trajectory: float
    us_per_span: float  # (on - off) / spans
    span_bytes: float  # mean size of a span's line in the trace file
    trajectories_per_step: int
    step_s: float  # the demo's median step
    overhead_ms_per_step: float  # (on - off) x trajectories per step
    share_of_step: float
    off_us_per_helper: float  # one no-op helper (a span's enter and exit) with tracing off
    section_s: float


def _tasks(n: int, group_size: int) -> list[Task]:
    return [
        Task(
            task_id=f"g{i // group_size}/{i % group_size}",
            group_id=f"g{i // group_size}",
            index_in_group=i % group_size,
            group_size=group_size,
            prompt_index=i // group_size,
            env="crossing",
            instance={"question": "x" * 200},
            kind="train",
            target_step=3,
            sampling=SamplingParams(max_tokens=32),
            deadline_s=120.0,
        )
        for i in range(n)
    ]


def _trajectory(task: Task, calls: int) -> Trajectory:
    turn = make_turn(
        prompt_ids=list(range(200)),
        context_len=0,
        generated_ids=list(range(32)),
        generated_logprobs=[-0.5] * 32,
        weight_version=2,
    )
    return Trajectory(
        task_id=task.task_id,
        group_id=task.group_id,
        index_in_group=task.index_in_group,
        group_size=task.group_size,
        prompt_index=task.prompt_index,
        env=task.env,
        kind=task.kind,
        target_step=task.target_step,
        launch_version=2,
        reward=1.0,
        status="ok",
        turns=[turn] * calls,
    )


def _one_round(tasks: list[Task], calls: int) -> None:
    """Every traced path of ``tasks``' trajectories, in the order the services run them."""
    with tracing_spans.issued(tasks):  # trainer
        wire = [encode(t) for t in tasks]
    published: list[bytes] = []
    for raw in wire:  # gateway, and the generator it calls
        task = decode(raw, Task)
        with tracing.active_span("rollout", tracing.context_of(task), tracing.task_attributes(task)) as span:
            for _ in range(calls):
                call = {"streamrl.generator_id": "generator-0", "url.path": "/v1/chat/completions"}
                with tracing.client_call("model_call", tracing.current(), _HEADERS, call) as headers:
                    with tracing.server_span("generate.chat", headers) as gen:
                        tracing.set_attributes(gen, _GENERATED)
            traj = _trajectory(task, calls)
            tracing.set_attributes(span, tracing.trajectory_attributes(traj))
            with tracing.span("trajectory.published", tracing.current(), {"streamrl.task_id": task.task_id}) as pub:
                tracing.stamp(traj, pub)
                published.append(encode(traj))
    trajs = [decode(raw, Trajectory) for raw in published]  # trainer
    size = tasks[0].group_size
    groups = [
        Group(f"g{i}", 3, size, i, rows={t.index_in_group: t for t in trajs[i * size : (i + 1) * size]})
        for i in range(len(trajs) // size)
    ]
    with tracing_spans.consumed(3, SampleResult(groups, [])):
        pass


def _cpu_round(tasks: list[Task], calls: int, trace_file: Path | None) -> float:
    """Process CPU seconds of one round; ``trace_file``: tracing on, spans written there."""
    if trace_file is not None:
        section = TracingSection(enabled=True, file=str(trace_file))
        tracing.setup(section, service="trainer", worker_id="bench", output_dir=trace_file.parent)
    t0 = time.process_time()
    _one_round(tasks, calls)
    tracing.shutdown()  # the exporter's queue written: counted
    return time.process_time() - t0


def _off_helper_us(n: int = 200_000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        with tracing.client_call("model_call", None, _HEADERS):
            pass
    return (time.perf_counter() - t0) / n * 1e6


def tracing_benchmark(work: Path, machine: str, *, demo_results: Path = DEMO_RESULTS) -> TracingResults:
    t_start = time.monotonic()
    cfg = load_config(RunConfig, DEMO_CONFIG, env={})
    group = cfg.grpo.num_generations_per_prompt
    per_step, calls = cfg.grpo.num_prompts_per_step * group, cfg.env.max_turns
    step_s = load(demo_results, DemoResults).timing.step.p50_s  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    off_helper = _off_helper_us()
    off, on, sizes = [], [], []
    for i in range(REPEATS):
        off.append(_cpu_round(_tasks(TRAJECTORIES, group), calls, None))
        path = work / f"round-{i}.jsonl"
        path.unlink(missing_ok=True)
        on.append(_cpu_round(_tasks(TRAJECTORIES, group), calls, path))
        sizes.append(path.stat().st_size / len(path.read_bytes().splitlines()))
    spans = 4 + 2 * calls  # issued, rollout, published, consumed; a model_call and a generate.chat per call
    off_us, on_us = (statistics.median(x) / TRAJECTORIES * 1e6 for x in (off, on))
    overhead_ms = (on_us - off_us) * per_step / 1e3
    return TracingResults(
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        trajectories=TRAJECTORIES,
        calls_per_trajectory=calls,
        spans_per_trajectory=spans,
        off_us_per_trajectory=off_us,
        on_us_per_trajectory=on_us,
        us_per_span=(on_us - off_us) / spans,
        span_bytes=statistics.median(sizes),
        trajectories_per_step=per_step,
        step_s=step_s,
        overhead_ms_per_step=overhead_ms,
        share_of_step=overhead_ms / 1e3 / step_s,
        off_us_per_helper=off_helper,
        section_s=time.monotonic() - t_start,
    )


def render_section(r: TracingResults) -> str:
    return render("tracing", r=r, target=TARGET_SHARE, met=r.share_of_step < TARGET_SHARE)


def main(argv: list[str] | None = None) -> TracingResults:
    ap = argparse.ArgumentParser(prog="python -m streamrl.bench.tracing", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--work-dir", type=Path, default=None, help="where the rounds' trace files go (default: a temp dir)"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    with tempfile.TemporaryDirectory() as tmp:
        results = tracing_benchmark(args.work_dir or Path(tmp), machine)
    if args.json:
        save(args.json, results)
    print(render_section(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

"""``streamrl bench``: measures and rewrites BENCHMARKS.md.

1. The demo run (`streamrl demo`, fresh): per-step wall time split into waiting for data,
   training and refit; trajectories per second through the streams; reward first/last 5 steps.
2. Stream transport, side by side in one process against one embedded Valkey: trajectories of a
   realistic size (a 2-turn rollout, 1,000+ tokens) published and consumed through the real
   StreamClient (XADD, XREADGROUP + decode + XACK), with token arrays packed as int32/float32 bytes
   versus the same payload as msgpack lists of numbers (the baseline the design rejects).
3. The generator (`streamrl.bench.generator`): HTTP layer against the raw vLLM engine in tokens/s,
   the cost of the prefix splice, and refit latency against a plain safetensors save + load.
4. The gym gateway (`streamrl.bench.gateway`): 256 concurrent multi-turn sessions through the
   session proxy against the same conversations sent straight to the generator: errors, latency,
   proxy overhead per call, memory per session; and the proxy alone at up to 4,096 sessions against
   a stand-in generator of fixed latency (`streamrl.bench.gateway_scale`).
5. The trainer (`streamrl.bench.trainer`): the torch backend's tokens/s against a bare torch loop
   of the same model, batch, loss and optimizer; two ranks against one; training state per rank
   at two ranks against one; asynchronous against synchronous sharded checkpoint saves.
6. Pipeline efficiency (`streamrl.bench.pipeline`): the real trainer, buffer, streams and gateways
   with simulated rollout and training times, at lag 0/1/2, against an ideal zero-overhead
   schedule of the same durations; and sequence-packing efficiency against padding.
7. Refit (`streamrl.bench.refit`): publish to confirmed from the trainer's learner to a vLLM
   generator process, filesystem and collective transports side by side, for models of 0.1 to
   2 GiB, against a raw gloo broadcast and a raw safetensors save + load of the same bytes; and
   those per-byte costs scaled to a 397B-parameter run (a model, next to published figures).
8. Demo variants (`streamrl.bench.demo_variants`): short demo runs at top_p 0.9 (the trainer's
   mismatch figures with and without the nucleus truncation, from the same run) and with dynamic
   sampling, against the demo's own settings.
9. OpenHands runners (`streamrl.bench.openhands`): the OpenHands driver with warm runners against
   a fresh runner process per rollout, rollouts per minute and CPU seconds per rollout.
Every figure is reported against a baseline measured in the same run on the same machine (so
noise from other load cancels out), as a ratio, or with its baseline named in its table.
``--only generator|gateway|gateway_scale|trainer|pipeline|refit|demo_variants|openhands`` runs one
section and rewrites only it in BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from shared import keys as K
from shared.config import load
from shared.protocol import Trajectory, encode, make_turn
from shared.redis_replies import read_entries
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect
from streamrl.bench import demo_variants as bench_demo_variants
from streamrl.bench import gateway as bench_gateway
from streamrl.bench import gateway_scale as bench_gateway_scale
from streamrl.bench import openhands as bench_openhands
from streamrl.bench import pipeline as bench_pipeline
from streamrl.bench import pipeline_report as bench_pipeline_report
from streamrl.bench import refit as bench_refit
from streamrl.bench import trainer as bench_trainer
from streamrl.bench.generator import HEADING as GENERATOR_HEADING
from streamrl.bench.generator import generator_benchmark, render_section, replace_section
from streamrl.redis_server import RedisServer

SECTIONS = ("generator", "gateway", "gateway_scale", "trainer", "pipeline", "refit", "demo_variants", "openhands")
DEMO_HEADING = "## Demo run"


def _trajectory(i: int, rng: np.random.Generator, prompt_len: int = 600, gen_len: int = 300) -> Trajectory:
    turns = [
        make_turn(
            prompt_ids=rng.integers(0, 150_000, prompt_len),
            context_len=0,
            generated_ids=rng.integers(0, 150_000, gen_len),
            generated_logprobs=-rng.random(gen_len),
            weight_version=3,
        ),
        make_turn(
            prompt_ids=rng.integers(0, 150_000, 60),
            context_len=prompt_len + gen_len,
            generated_ids=rng.integers(0, 150_000, gen_len),
            generated_logprobs=-rng.random(gen_len),
            weight_version=3,
        ),
    ]
    return Trajectory(
        task_id=f"g{i}/0",
        group_id=f"g{i}",
        index_in_group=0,
        group_size=1,
        prompt_index=i,
        env="bench",
        kind="train",
        target_step=4,
        launch_version=3,
        reward=1.0,
        status="ok",
        turns=turns,
    )


class _ListTurn(msgspec.Struct):
    prompt_ids: list[int]
    generated_ids: list[int]
    generated_logprobs: list[float]


class _ListTrajectory(msgspec.Struct):
    task_id: str
    turns: list[_ListTurn]


def _as_lists(t: Trajectory) -> _ListTrajectory:
    return _ListTrajectory(
        t.task_id, [_ListTurn(x.prompt().tolist(), x.generated().tolist(), x.logprobs().tolist()) for x in t.turns]
    )


async def _stream_round(redis_url: str, payloads: list[bytes], decode: Callable[[bytes], object]) -> dict[str, float]:
    redis = connect(redis_url)
    keys = K.RunKeys(f"bench-{uuid.uuid4().hex[:6]}")
    sc = StreamClient(redis, keys, "bench")
    await sc.ensure_group(keys.trajectories, K.TRAINER_GROUP)
    t0 = time.perf_counter()
    for i in range(0, len(payloads), 100):
        async with redis.pipeline(transaction=False) as pipe:
            for p in payloads[i : i + 100]:
                pipe.xadd(keys.trajectories, {K.ENTRY_FIELD: p})
            await pipe.execute()
    t1 = time.perf_counter()
    got = 0
    while got < len(payloads):
        reply = await redis.xreadgroup(K.TRAINER_GROUP, "bench", {keys.trajectories: ">"}, count=200, block=1000)
        entries = read_entries(reply)
        for _, fields in entries:
            assert fields is not None  # new entries (">") always carry their fields
            decode(fields[K.ENTRY_FIELD])
        await redis.xack(keys.trajectories, K.TRAINER_GROUP, *[e for e, _ in entries])
        got += len(entries)
    t2 = time.perf_counter()
    await redis.delete(keys.trajectories)
    await redis.aclose()
    n = len(payloads)
    return {
        "produce_per_s": n / (t1 - t0),
        "consume_per_s": n / (t2 - t1),
        "end_to_end_per_s": n / (t2 - t0),
        "bytes": float(np.mean([len(p) for p in payloads])),
    }


def stream_benchmark(redis_url: str, n: int = 3000) -> dict[str, dict[str, float]]:
    from shared.protocol import decode as decode_msg

    rng = np.random.default_rng(0)
    trajs = [_trajectory(i, rng) for i in range(n)]
    packed = [encode(t) for t in trajs]
    lists = [msgspec.msgpack.encode(_as_lists(t)) for t in trajs]
    list_decoder = msgspec.msgpack.Decoder(_ListTrajectory)
    out = {}
    for name, payloads, dec in (
        ("packed", packed, lambda b: decode_msg(b, Trajectory)),
        ("lists", lists, list_decoder.decode),
    ):
        runs = [asyncio.run(_stream_round(redis_url, payloads, dec)) for _ in range(3)]
        out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out


def demo_benchmark(out_dir: Path) -> dict[str, Any]:
    import shutil

    from shared.records import read_records, step_records
    from streamrl.demo import CONFIG, run_demo, summarize

    shutil.rmtree(out_dir, ignore_errors=True)  # time the warm start too
    code = run_demo(out_dir, progress=False)
    steps = step_records(read_records(out_dir / "metrics.jsonl"))
    cfg = load(RunConfig, CONFIG, env={})
    phases = {
        "wait_data_s": [r.timing.wait_data_s for r in steps],
        "train_s": [r.timing.train_s for r in steps],
        "refit_s": [r.refit.total_s for r in steps],
        "step_s": [r.timing.step_s for r in steps],
    }
    stats = (
        {k: {"mean": statistics.mean(v), "p50": statistics.median(v), "max": max(v)} for k, v in phases.items()}
        if steps
        else {}
    )
    summary = (
        json.loads((out_dir / "summary.json").read_text())
        if (out_dir / "summary.json").is_file()
        else summarize(out_dir)
    )
    return {
        "exit_code": code,
        "summary": summary,
        "timing": stats,
        "trajectories_per_s": steps[-1].trajectories_per_s if steps else 0.0,
        "staleness_mean": statistics.mean(r.staleness.mean for r in steps) if steps else 0.0,
        "loop_s": sum(phases["step_s"]),
        "max_num_steps": cfg.grpo.max_num_steps,
        "lag": cfg.grpo.async_grpo.max_trajectory_age_steps,
    }


def _ratio(value: float, base: float, fmt: str = "{:.2f}x") -> str:
    return fmt.format(value / base) if base else "n/a"


def render_demo(demo: dict[str, Any]) -> str:
    """The demo section: the per-step split as shares of the whole step, the run's counts, and
    each figure that has a like baseline in the same run (reward against the first steps,
    staleness against its bound, time against time) next to it."""
    s, timing = demo["summary"], demo["timing"]
    step = timing.get("step_s", {}).get("mean", 0.0)
    lines = [
        f"{DEMO_HEADING} (`streamrl demo`: crossing tool-use task, tiny Qwen3, 8 prompts x 8 rollouts per step, lag 1, "
        "vLLM on CPU)",
        "",
        "| per-step wall time | mean (s) | p50 (s) | max (s) | mean / whole step (baseline) |",
        "|---|---|---|---|---|",
    ]
    names = {
        "wait_data_s": "waiting for data",
        "train_s": "training",
        "refit_s": "refit (publish to all confirmed)",
        "step_s": "whole step",
    }
    for k, label in names.items():
        if k in timing:
            v = timing[k]
            lines.append(
                f"| {label} | {v['mean']:.2f} | {v['p50']:.2f} | {v['max']:.2f} | {_ratio(v['mean'], step, '{:.1%}')} |"
            )
    acc = [a for _, a in s.get("validation_accuracy", [])]
    total_s, trained = s.get("total_time_s", 0.0), s.get("trajectories_trained", 0)
    lines += [
        "",
        "| run figure | value |",
        "|---|---|",
        f"| steps trained (of grpo.max_num_steps {demo['max_num_steps']}) | {s.get('steps', 0)} |",
        f"| trajectories trained per second (whole run, wall clock) | {demo['trajectories_per_s']:.1f} |",
    ]
    rows = [
        (
            "mean reward, last 5 steps",
            f"{s.get('last5_reward', 0):.3f}",
            f"first 5 steps: {s.get('first5_reward', 0):.3f}",
            _ratio(s.get("last5_reward", 0), s.get("first5_reward", 0)),
        ),
        (
            "mean staleness of consumed groups (steps)",
            f"{demo['staleness_mean']:.2f}",
            f"the lag bound (max_trajectory_age_steps): {demo['lag']}",
            _ratio(demo["staleness_mean"], demo["lag"]),
        ),
        (
            "trajectories trained twice",
            f"{s.get('duplicate_ids', 0)}",
            f"trajectories trained: {trained}",
            _ratio(s.get("duplicate_ids", 0), trained, "{:.0%}"),
        ),
        (
            "validation accuracy (greedy) at the end",
            f"{acc[-1]:.3f}" if acc else "n/a",
            f"at the start: {acc[0]:.3f}" if acc else "n/a",
            _ratio(acc[-1], acc[0]) if acc else "n/a",
        ),
        (
            "demo total time incl. data, warm start, engine start (min)",
            f"{total_s / 60:.1f}",
            f"its training loop (sum of step times): {demo['loop_s'] / 60:.1f} min",
            _ratio(total_s, demo["loop_s"]),
        ),
    ]
    lines += ["", "| compared figure | value | baseline (same run) | value / baseline |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {base} | {ratio} |" for name, value, base, ratio in rows]
    return "\n".join(lines) + "\n"


def render_streams(streams: dict[str, dict[str, float]]) -> str:
    lines = [
        "## Stream transport (one Valkey, real StreamClient, 3,000 trajectories of ~1,260 tokens, median of 3)",
        "",
        "| token arrays as | entry bytes | publish /s | consume+decode+ack /s | end to end /s |",
        "|---|---|---|---|---|",
    ]
    keys = ("bytes", "produce_per_s", "consume_per_s", "end_to_end_per_s")
    for name, label in (("packed", "packed int32/float32 (ours)"), ("lists", "msgpack lists (baseline)")):
        v = streams[name]
        lines.append(f"| {label} | " + " | ".join(f"{v[k]:.0f}" for k in keys) + " |")
    packed, lists = streams["packed"], streams["lists"]
    lines.append("| packed / lists, same run | " + " | ".join(_ratio(packed[k], lists[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def render(
    demo: dict[str, Any],
    streams: dict[str, dict[str, float]],
    machine: str,
    generator: dict[str, Any],
    gateway: dict[str, Any],
    gateway_scale: dict[str, Any],
    trainer: dict[str, Any],
    pipeline: dict[str, Any],
    refit: dict[str, Any],
    variants: dict[str, Any],
    openhands: dict[str, Any],
) -> str:
    head = (
        f"# Benchmarks\n\nWritten by `streamrl bench` on {time.strftime('%Y-%m-%d')} ({machine}). Re-run it to "
        "refresh every table. A figure that has a baseline of its kind stands next to it, measured in the same "
        "run; counts without one stand alone.\n\n"
    )
    return (
        head
        + render_demo(demo)
        + "\n"
        + bench_demo_variants.render_section(variants)
        + "\n"
        + render_streams(streams)
        + "\n"
        + render_section(generator)
        + "\n"
        + bench_gateway.render_section(gateway)
        + "\n"
        + bench_gateway_scale.render_section(gateway_scale)
        + "\n"
        + bench_openhands.render_section(openhands)
        + "\n"
        + bench_trainer.render_section(trainer)
        + "\n"
        + bench_refit.render_section(refit)
        + "\n"
        + bench_pipeline_report.render_pipeline(pipeline)
    )


def run_benchmarks(out: Path, only: str | None = None) -> int:
    """Every section (``only=None``), or the one named by ``only`` with the rest of ``out`` kept."""
    if only is not None and only not in SECTIONS:
        raise ValueError(f"unknown bench section {only!r}; one of: {', '.join(SECTIONS)}")
    machine = f"{platform.machine()}, {__import__('os').cpu_count()} cores, Python {platform.python_version()}"
    tmp = Path("runs/bench")
    demo = demo_benchmark(tmp / "demo") if only is None else None
    variants = (
        bench_demo_variants.demo_variants_benchmark(tmp / "demo_variants", machine)
        if only in (None, "demo_variants")
        else None
    )
    server = RedisServer(tmp / "redis", tied_to_parent=True)
    server.start()
    try:
        streams = stream_benchmark(server.url) if only is None else None
        generator = generator_benchmark(tmp / "generator", server.url, machine) if only in (None, "generator") else None
        gateway = (
            bench_gateway.gateway_benchmark(tmp / "gateway", server.url, machine) if only in (None, "gateway") else None
        )
        refit = bench_refit.refit_benchmark(tmp / "refit", server.url, machine) if only in (None, "refit") else None
    finally:
        server.stop()
    trainer = bench_trainer.trainer_benchmark(tmp / "trainer", machine) if only in (None, "trainer") else None
    scale = (
        bench_gateway_scale.gateway_scale_benchmark(tmp / "gateway_scale", machine)
        if only in (None, "gateway_scale")
        else None
    )
    openhands = bench_openhands.openhands_benchmark(tmp / "openhands", machine) if only in (None, "openhands") else None
    pipeline = bench_pipeline.run_pipeline_benchmark(tmp / "pipeline") if only in (None, "pipeline") else None
    results_path = tmp / "bench.json"
    if only is None:
        # only=None ran every section
        assert demo is not None and streams is not None and generator is not None and gateway is not None
        assert trainer is not None and pipeline is not None and refit is not None and variants is not None
        assert openhands is not None and scale is not None
        text = render(demo, streams, machine, generator, gateway, scale, trainer, pipeline, refit, variants, openhands)
        results = {
            "demo": demo,
            "demo_variants": variants,
            "streams": streams,
            "generator": generator,
            "gateway": gateway,
            "gateway_scale": scale,
            "trainer": trainer,
            "pipeline": pipeline,
            "refit": refit,
            "openhands": openhands,
        }
    else:
        text = out.read_text() if out.is_file() else "# Benchmarks\n"
        if variants is not None:
            section = bench_demo_variants.render_section(variants)
            text = replace_section(text, section, bench_demo_variants.HEADING, after=DEMO_HEADING)
        if generator is not None:
            text = replace_section(text, render_section(generator), GENERATOR_HEADING)
        if gateway is not None:
            text = replace_section(
                text, bench_gateway.render_section(gateway), bench_gateway.HEADING, after=GENERATOR_HEADING
            )
        if scale is not None:
            section = bench_gateway_scale.render_section(scale)
            text = replace_section(text, section, bench_gateway_scale.HEADING, after=bench_gateway.HEADING)
        if openhands is not None:
            text = replace_section(
                text, bench_openhands.render_section(openhands), bench_openhands.HEADING, after=bench_gateway.HEADING
            )
        if trainer is not None:
            text = replace_section(
                text, bench_trainer.render_section(trainer), bench_trainer.HEADING, after=bench_gateway.HEADING
            )
        if refit is not None:
            text = replace_section(
                text, bench_refit.render_section(refit), bench_refit.HEADING, after=bench_trainer.HEADING
            )
        if pipeline is not None:
            text = replace_section(text, bench_pipeline_report.render_pipeline(pipeline), bench_pipeline_report.HEADING)
        results = json.loads(results_path.read_text()) if results_path.is_file() else {}
        results.update(
            {
                k: v
                for k, v in (
                    ("generator", generator),
                    ("gateway", gateway),
                    ("gateway_scale", scale),
                    ("trainer", trainer),
                    ("pipeline", pipeline),
                    ("refit", refit),
                    ("demo_variants", variants),
                    ("openhands", openhands),
                )
                if v is not None
            }
        )
    out.write_text(text)
    results_path.write_text(json.dumps(results, indent=2))
    print(text)
    codes = [demo["exit_code"]] if demo is not None else []
    codes += [r["exit_code"] for r in variants["runs"].values()] if variants is not None else []
    return 0 if all(c == 0 for c in codes) else 1

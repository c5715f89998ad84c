"""The pipeline-efficiency section of ``streamrl bench``: how close the real trainer loop comes to
its own scheduling policy run at zero overhead, and what asynchrony buys over synchronous GRPO.
This module runs the real loop; `streamrl.bench_schedule` holds the scenarios and the ideal
schedule, `streamrl.bench_pipeline_report` the tables and targets.

Real parts, against one embedded Valkey: the `TrainerRuntime` in this process (scheduler, replay
buffer, streams, lookahead barrier, refit through the `WeightPublisher` with its launch gate and
confirmations, acks, metrics) and GATEWAY_WORKERS `GatewayWorker`s built as the gateway app builds
one (tasks stream in, one session per rollout through the real `SessionProxy`, trajectories out),
in a process of their own as in a deployment. Simulated parts, so the loop is measured and not a model:

* rollouts: a benchmark-only environment (registered for the run only) sleeps a log-normal
  duration and calls no model. Each prompt's k-th attempt has a fixed, seeded set of G durations,
  so the real run and the ideal schedule see the same rollout times. A rollout with no model call
  has no turns: the trainer treats its rows as placeholders, which costs nothing here.
* training: `SimBackend.train_step` sleeps the scenario's training time (`TrainerRuntime` with
  `_build_backend` overridden); ``save_weights`` writes a 64-byte file.
* generators: `SimGenerator`, in a third process, registers a generator heartbeat and confirms
  every weight announcement at once (the heartbeat carries the new version before the ack).

The gateway's generator pool re-reads the registry for every session (``refresh_s=0``; the
product default caches it for 1 s). A rollout without model calls is stamped with the version the
pool reports when its session opens, and a cached answer one refit old would make groups look one
version staler than they are, so the buffer would evict them; rollouts that call the model are
stamped by the generator's responses and do not depend on the cache. At real step lengths (minutes)
every burst of new sessions finds the 1 s cache expired anyway, so each session of a burst reads
the registry there too.

The ideal schedule (`simulate_schedule`) is a small event simulator with the same durations and
the same lag rule at zero overhead: refit, task issue and trajectory delivery take no time, and
concurrency is unlimited (the real gateways' slots stay above the peak the run reaches; the
peak is reported). It follows the trainer's policy step by step: start-up issues targets
[0, L] and waits for complete batches of targets 0 and 1 (L > 0); step s takes N usable groups
(staged for s, then late ones, then future ones; usable when the weight version that generated
them is in [s - L, s]), evicting stale ones (their prompts are reused); after training, the
window [s + 1, s + 1 + L] is topped up to N groups per target, in flight or staged, with the
weights of step s + 1. Steps per hour and the trainer's busy fraction (time in train_step / wall
time) are measured from the end of training of step MEASURE_FROM_STEP to the end of the last,
for the real run and the ideal schedule alike. The real runs also break down where their time goes
(refit, waiting for data, task pickup, session open, delivery) and how much CPU other processes of
the host took meanwhile; a run disturbed by them is repeated (`measured_run`).

Packing: a step's sequence lengths drawn log-normal (SWE-like, clipped to the context length),
first-fit-decreasing packs of one context length against padding micro-batches to their longest row.

`run_pipeline_benchmark` returns the results; `render_pipeline` turns them into the markdown
section; ``python -m streamrl.bench_pipeline`` runs and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np

from services.gym_gateway import envs
from services.gym_gateway.envs.base import ChatClient, Outcome
from services.gym_gateway.proxy import GeneratorPool, SessionProxy
from services.gym_gateway.worker import GatewayWorker
from services.trainer.batch import StepBatch
from services.trainer.metrics_log import read_metrics
from services.trainer.packing import first_fit_decreasing, packing_efficiency, padding_efficiency
from services.trainer.runtime import TrainerRuntime
from shared import keys as K
from shared.protocol import Heartbeat, Trajectory, WeightAck, WeightAnnouncement, decode
from shared.registry import HeartbeatTask, publish_heartbeat
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect
from streamrl.bench_pipeline_report import (
    CONTENDED_OTHER_CPU,
    CONTENDED_OVERSHOOT_S,
    REAL_RUN_ATTEMPTS,
    render_pipeline,
)
from streamrl.bench_schedule import (
    LAGS,
    MEASURE_FROM_STEP,
    SCENARIOS,
    Scenario,
    ideal_run,
    long_run_speedups,
    pipeline_figures,
)
from streamrl.redis_server import RedisServer

ENV_NAME = "bench_sleep"
GATEWAY_WORKERS = 8  # x gym_gateway.max_concurrent_rollouts (64): far above the peak, slots never limit generation
ROOT = Path(__file__).resolve().parents[1]


# -- the real loop with simulated generation and training -------------------------------------------


class SimBackend:
    """A training backend whose step takes ``train_s`` and whose weights are 64 bytes."""

    def __init__(self, train_s: float) -> None:
        self.train_s = train_s
        self.spans: list[tuple[float, float]] = []  # perf_counter start, end of every train_step

    def train_step(self, batch: StepBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        time.sleep(self.train_s)
        self.spans.append((t0, time.perf_counter()))
        return {"sim_rows": float(len(batch.rows))}

    def save_weights(self, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(bytes(64))


class SimTrainer(TrainerRuntime):
    """The real trainer runtime with `SimBackend` as its learner; it also notes when each group was
    issued and when each trajectory reached it, for the latency breakdown."""

    def __init__(self, cfg: RunConfig, *, train_s: float) -> None:
        super().__init__(cfg, worker_id="trainer-sim", url="http://trainer.sim")
        self.train_s = train_s
        self.issued_at: dict[int, float] = {}  # group sequence number -> wall time its tasks were published
        self.received_at: dict[str, float] = {}  # task id -> wall time the trainer read its trajectory

    def _build_backend(self) -> SimBackend:
        return SimBackend(self.train_s)

    async def _issue(self) -> None:
        first = self.scheduler.group_seq
        await super()._issue()
        now = time.time()
        self.issued_at.update((seq, now) for seq in range(first, self.scheduler.group_seq))

    async def _accept(self, entry_id: str, traj: Trajectory) -> None:
        self.received_at[traj.task_id] = time.time()
        await super()._accept(entry_id, traj)


class SleepEnv:
    """Benchmark-only environment: a prompt's rollouts sleep the scenario's durations, in order
    (its k-th rollout is row k % G of attempt k // G), and call no model."""

    name = ENV_NAME

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.started: dict[int, int] = defaultdict(int)
        self.running = 0
        self.peak = 0

    def next_duration(self, prompt: int) -> float:
        k = self.started[prompt]
        self.started[prompt] += 1
        g = self.scenario.group_size
        return self.scenario.durations(prompt, k // g)[k % g]

    async def rollout(self, instance: dict[str, Any], llm: ChatClient, *, max_turns: int) -> Outcome:
        seconds = self.next_duration(int(instance["prompt"]))
        sleep_from = time.time()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
        return Outcome(reward=0.0, metrics={"sim_rollout_s": seconds, "sim_sleep_from": sleep_from})


def registered_env(env: SleepEnv):
    """Make ``env`` resolvable by name for the duration of a run."""
    return envs.registered(env)


class SimGenerator:
    """Plays a generator: a registry heartbeat, and an immediate ack of every weight announcement
    (the heartbeat carries the new version before the ack goes out). Ends when the run stops."""

    def __init__(self, redis_url: str, run_id: str) -> None:
        self.worker_id = "generator-sim"
        self.redis = connect(redis_url)
        self.streams = StreamClient(self.redis, K.RunKeys(run_id), self.worker_id)
        self.version = -1

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            kind="generator",
            url="http://generator.sim",
            pid=os.getpid(),
            host="sim",
            state="ready",
            weight_version=self.version,
        )

    async def run(self) -> None:
        keys = self.streams.keys
        await publish_heartbeat(self.redis, keys, self._heartbeat())
        heartbeat = HeartbeatTask(self.redis, keys, self._heartbeat)
        heartbeat.start()
        cursor = "0-0"
        try:
            while not await self.redis.exists(keys.stop):
                for d in await self.streams.read_after(keys.weights, cursor, WeightAnnouncement, block_ms=200):
                    cursor = d.entry_id
                    self.version = d.msg.version
                    await publish_heartbeat(self.redis, keys, self._heartbeat())
                    ack = WeightAck(worker_id=self.worker_id, version=self.version, ok=True, cache_reset=True)
                    await self.streams.publish(keys.weight_acks, ack)
        finally:
            await heartbeat.aclose(self.worker_id)
            await self.redis.aclose()


async def serve_gateways(cfg: RunConfig, scenario: Scenario, report: Path) -> None:
    """GATEWAY_WORKERS gateway workers as `services.gym_gateway.app` builds one (own Redis client,
    session proxy, the config's slots), sharing one process; they end when the run stops."""
    env = SleepEnv(scenario)
    keys = K.RunKeys(cfg.run.run_id)
    gw = cfg.gym_gateway
    http = aiohttp.ClientSession()
    clients, workers = [], []
    with registered_env(env):
        for i in range(GATEWAY_WORKERS):
            redis = connect(cfg.redis.url)
            gateway_id = f"gateway-sim-{i}"
            pool = GeneratorPool(redis, keys, refresh_s=0.0)
            proxy = SessionProxy(pool, http, request_timeout_s=gw.request_timeout_s)
            clients.append(redis)
            workers.append(
                GatewayWorker(
                    StreamClient(redis, keys, gateway_id),
                    proxy,
                    http,
                    session_base_url="http://gateway.sim",
                    max_concurrent=gw.max_concurrent_rollouts,
                    reclaim_idle_s=gw.reclaim_idle_s,
                    max_turns=cfg.env.max_turns,
                    gateway_id=gateway_id,
                    carry_mask_flag=cfg.env.should_mask_flagged_samples,
                )
            )
        try:
            await asyncio.gather(*(w.run() for w in workers))
        finally:
            for w in workers:
                await w.drain(0.0)  # stragglers still running when the last step ended
            await http.close()
            for redis in clients:
                await redis.aclose()
    failed: dict[str, int] = defaultdict(int)
    for w in workers:
        for reason, n in w.failed.items():
            failed[reason] += n
    report.write_text(
        json.dumps(
            {"peak_rollouts": env.peak, "rollouts_started": sum(env.started.values()), "failed_rollouts": dict(failed)}
        )
    )


def serve(argv: list[str]) -> None:
    """Entry point of a helper process: ``generator|gateway <config.json> <scenario.json> <report.json>``."""
    role, config, scenario, report = argv
    cfg = msgspec.json.decode(Path(config).read_bytes(), type=RunConfig)
    if role == "generator":
        asyncio.run(SimGenerator(cfg.redis.url, cfg.run.run_id).run())
    else:
        s = Scenario(**json.loads(Path(scenario).read_text()))
        asyncio.run(serve_gateways(cfg, s, Path(report)))


def _spawn(role: str, work: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from streamrl.bench_pipeline import serve; serve(sys.argv[1:])",
        role,
        str(work / "config.json"),
        str(work / "scenario.json"),
        str(work / f"{role}.report.json"),
    ]
    with open(work / f"{role}.log", "wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def run_config(scenario: Scenario, lag: int, *, redis_url: str, run_id: str, work: Path) -> RunConfig:
    """The run's config (product defaults but for the scenario's sizes, the lag and the benchmark's
    environment); its dataset holds ``{"prompt": i}`` rows in order."""
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in range(scenario.dataset_size)))
    tree = {
        "run": {"run_id": run_id, "output_dir": str(work / "out"), "seed": scenario.seed},
        "redis": {"url": redis_url},
        "data": {"train_path": str(data), "shuffle": False},
        "policy": {"model_name": "simulated"},
        "grpo": {
            "num_prompts_per_step": scenario.num_prompts,
            "num_generations_per_prompt": scenario.group_size,
            "max_num_steps": scenario.steps,
            "async_grpo": {"max_trajectory_age_steps": lag},
        },
        "env": {"name": ENV_NAME},
        "checkpointing": {"enabled": False},
        "logger": {"plot": False},
        "trainer": {"refit_timeout_s": 60.0, "startup_timeout_s": 120.0, "data_timeout_s": 600.0},
    }
    cfg = msgspec.convert(tree, RunConfig)
    cfg.check()
    return cfg


async def _train(cfg: RunConfig, train_s: float) -> tuple[SimTrainer, list[Trajectory]]:
    """Run the trainer to the end; it and the run's trajectories (read back from the stream)."""
    trainer = SimTrainer(cfg, train_s=train_s)
    await trainer.start()
    try:
        await trainer.run()
        entries = await trainer.redis.xrange(trainer.keys.trajectories)
    finally:
        await trainer.aclose()
    return trainer, [decode(fields[K.ENTRY_FIELD], Trajectory) for _, fields in entries]


def rollout_latencies(
    trajs: list[Trajectory], issued_at: dict[int, float], received_at: dict[str, float]
) -> dict[str, float]:
    """Where a rollout's time goes outside its simulated duration, over the groups issued after
    start-up (the first issue, which meets the gateway still starting, is left out): pickup (task
    published -> the gateway starts the rollout), session open (-> the environment starts), delivery
    (rollout done -> the trainer reads the trajectory), and per issue the delay until the last of its
    rollouts starts (what stretches a batch's makespan)."""
    first = min(issued_at.values())
    pickup, opening, delivery = [], [], []
    last_start: dict[float, float] = defaultdict(float)
    for t in trajs:
        issued = issued_at.get(int(t.group_id[-7:]))  # group ids end in the 7-digit sequence number
        if issued is None or issued <= first or t.task_id not in received_at:
            continue
        pickup.append(t.started_at - issued)
        opening.append(t.metrics["sim_sleep_from"] - t.started_at)
        delivery.append(received_at[t.task_id] - t.finished_at)
        last_start[issued] = max(last_start[issued], t.metrics["sim_sleep_from"] - issued)
    return {
        "pickup_mean_s": statistics.mean(pickup),
        "pickup_max_s": max(pickup),
        "open_mean_s": statistics.mean(opening),
        "open_max_s": max(opening),
        "delivery_mean_s": statistics.mean(delivery),
        "delivery_max_s": max(delivery),
        "last_start_mean_s": statistics.mean(last_start.values()),
    }


_CLK = os.sysconf("SC_CLK_TCK")


def host_busy_cpu_s() -> float:
    """CPU seconds every core of the host has spent busy since boot (/proc/stat)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(v) - v[3] - v[4]) / _CLK  # all but idle and iowait


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def own_cpu_s(server_pid: int | None) -> float:
    """CPU seconds of this process, its waited-for children and the Valkey server."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + (process_cpu_s(server_pid) if server_pid else 0.0)


def real_run(scenario: Scenario, lag: int, redis_url: str, work: Path, server_pid: int | None = None) -> dict[str, Any]:
    """One run of the real trainer (this process) against the generator stand-in and the gateway
    workers (a process each, started here and ending with the run). ``other_cpu_cores``: the CPU
    other processes of the host used meanwhile (the Valkey server counts as ours when its pid is given)."""
    wall0, host0, own0 = time.monotonic(), host_busy_cpu_s(), own_cpu_s(server_pid)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run_id = f"pipeline-{scenario.name}-lag{lag}-{uuid.uuid4().hex[:6]}"
    cfg = run_config(scenario, lag, redis_url=redis_url, run_id=run_id, work=work)
    (work / "config.json").write_bytes(msgspec.json.encode(cfg))
    (work / "scenario.json").write_text(json.dumps(asdict(scenario)))
    helpers = [_spawn("generator", work), _spawn("gateway", work)]
    try:
        trainer, trajs = asyncio.run(_train(cfg, scenario.train_s))
    finally:
        for p in helpers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(10)
    if any(p.returncode for p in helpers):
        raise RuntimeError(f"a helper process failed; see {work}/generator.log and {work}/gateway.log")
    other_cpu = (host_busy_cpu_s() - host0) - (own_cpu_s(server_pid) - own0)
    wall = time.monotonic() - wall0
    gateway = json.loads((work / "gateway.report.json").read_text())
    records = [r for r in read_metrics(work / "out" / "metrics.jsonl") if r.get("kind") == "train"]
    measured = records[MEASURE_FROM_STEP + 1 :]
    starts, ends = [s for s, _ in trainer.backend.spans], [e for _, e in trainer.backend.spans]
    gaps = [b - a for a, b in zip(ends[MEASURE_FROM_STEP:-1], starts[MEASURE_FROM_STEP + 1 :], strict=True)]
    return {
        **pipeline_figures(starts, ends),
        **gateway,
        **rollout_latencies(trajs, trainer.issued_at, trainer.received_at),
        "max_train_overshoot_s": max(e - b for b, e in trainer.backend.spans) - scenario.train_s,
        "other_cpu_cores": other_cpu / wall,
        "run_wall_s": wall,
        "issued_groups": trainer.scheduler.issued_total,
        "evicted_groups": trainer.buffer.evicted_total,
        "duplicates": trainer.buffer.duplicates_total,
        "mean_gap_s": statistics.mean(gaps),
        "mean_refit_s": statistics.mean(r["time_refit_s"] for r in measured),
        "max_refit_s": max(r["time_refit_s"] for r in measured),
        "mean_wait_data_s": statistics.mean(r["time_wait_data_s"] for r in measured),
        "max_staleness": max(r["staleness_max"] for r in records),
    }


# -- packing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackingCase:
    rows: int = 512  # one step: 32 prompts x 16 rollouts
    median_tokens: int = 6000
    sigma: float = 1.0
    max_len: int = 32768  # token budget of a pack and the context length rows are clipped to
    micro_batch_size: int = 8
    batches: int = 20


def packing_lengths(case: PackingCase, seed: int) -> list[int]:
    z = np.random.default_rng(seed).standard_normal(case.rows)
    return [int(min(case.max_len, max(1, round(case.median_tokens * math.exp(case.sigma * x))))) for x in z]


def packing_benchmark(case: PackingCase = PackingCase()) -> dict[str, Any]:
    packed, padded, packs, lower = [], [], [], []
    for seed in range(case.batches):
        lengths = packing_lengths(case, seed)
        p = first_fit_decreasing(lengths, case.max_len)
        packed.append(packing_efficiency(lengths, p, case.max_len))
        padded.append(padding_efficiency(lengths, case.micro_batch_size))
        packs.append(len(p))
        lower.append(math.ceil(sum(lengths) / case.max_len))
    return {
        "case": asdict(case),
        "packing_mean": statistics.mean(packed),
        "packing_min": min(packed),
        "padding_mean": statistics.mean(padded),
        "padding_min": min(padded),
        "packs_mean": statistics.mean(packs),
        "packs_lower_bound_mean": statistics.mean(lower),
    }


# -- the whole section -----------------------------------------------------------------------------


def scenario_facts(s: Scenario) -> dict[str, Any]:
    draws = [d for p in range(200) for d in s.durations(p, 0)]
    return {
        **asdict(s),
        "rollout_median_s": s.rollout_median_s,
        "p99_over_p50": s.p99_over_p50,
        "sampled_p99_over_p50": float(np.quantile(draws, 0.99) / np.quantile(draws, 0.5)),
    }


def measured_run(scenario: Scenario, lag: int, redis_url: str, work: Path, server_pid: int | None) -> dict[str, Any]:
    """`real_run`, repeated (up to REAL_RUN_ATTEMPTS) while it was disturbed: other processes of the
    host took more than CONTENDED_OTHER_CPU cores, or a training sleep overshot by more than
    CONTENDED_OVERSHOOT_S (the trainer could not get a core). Such a run measures the host as much
    as the pipeline. The least disturbed attempt is kept, with the number of attempts."""
    attempts: list[dict[str, Any]] = []
    while len(attempts) < REAL_RUN_ATTEMPTS:
        attempts.append(real_run(scenario, lag, redis_url, work, server_pid))
        if not _contended(attempts[-1]):
            break
    return {**min(attempts, key=lambda r: (_contended(r), r["other_cpu_cores"])), "attempts": len(attempts)}


def _contended(run: dict[str, Any]) -> bool:
    return run["max_train_overshoot_s"] > CONTENDED_OVERSHOOT_S or run["other_cpu_cores"] > CONTENDED_OTHER_CPU


def run_pipeline_benchmark(
    work_dir: Path = Path("runs/bench/pipeline"),
    redis_url: str | None = None,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
) -> dict[str, Any]:
    """Every scenario at every lag, real and ideal, plus the packing figures. Starts its own
    Valkey unless ``redis_url`` is given."""
    server = None
    if redis_url is None:
        server = RedisServer(work_dir / "redis")
        server.start()
        redis_url = server.url
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "measure_from_step": MEASURE_FROM_STEP,
        "gateway_workers": GATEWAY_WORKERS,
        "gateway_slots_per_worker": RunConfig().gym_gateway.max_concurrent_rollouts,
        "scenarios": {},
    }
    try:
        for s in scenarios:
            runs = {}
            for lag in LAGS:
                real = measured_run(s, lag, redis_url, work_dir / f"{s.name}-lag{lag}", server and server.proc.pid)
                runs[str(lag)] = {"real": real, "ideal": ideal_run(s, lag)}
            long_run = long_run_speedups(s)
            out["scenarios"][s.name] = {
                "facts": scenario_facts(s),
                "runs": runs,
                "long_run_ideal_speedup": {str(k): v for k, v in long_run.items()},
            }
    finally:
        if server is not None:
            server.stop()
    out["packing"] = packing_benchmark()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m streamrl.bench_pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("runs/bench/pipeline"))
    ap.add_argument("--out", type=Path, help="also write the markdown section here")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    results = run_pipeline_benchmark(args.work_dir)
    text = render_pipeline(results)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(text)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

"""The pipeline-efficiency section of ``streamrl bench``: how close the real trainer loop comes to
its own scheduling policy run at zero overhead, and what asynchrony buys over synchronous GRPO.
This module runs the real loop; `streamrl.bench.schedule` holds the scenarios and the ideal
schedule, `streamrl.bench.pipeline_report` the tables and targets.

Real parts, against one embedded Valkey: the trainer's `ControlPlane` in this process (scheduler,
replay buffer, intake, lookahead barrier, refit through the `WeightPublisher` with its launch gate
and confirmations, acks, records), plugged in through its declared seams (a `LocalLearner` around
the simulated backend, and `TrainerHooks` noting when groups were issued and trajectories read),
and GATEWAY_WORKERS real gateway workers in a process of their own. Simulated, so the loop is
measured and not a model (`streamrl.bench.pipeline_sim`): rollouts (an environment that sleeps a
seeded log-normal duration per rollout and calls no model), training (a backend that sleeps the
scenario's training time) and the generator (a process that confirms every weight version at once).

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

Packing (`streamrl.bench.packing`): a step's sequence lengths drawn log-normal (SWE-like, clipped
to the context length), first-fit-decreasing packs of one context length against padding
micro-batches to their longest row.

`run_pipeline_benchmark` returns the section's `PipelineResults` (`streamrl.bench.pipeline_report`,
which renders them); ``python -m streamrl.bench.pipeline`` runs and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import msgspec
import numpy as np

from services.trainer.control_plane import ControlPlane, TrainerHooks
from services.trainer.learner import LocalLearner
from shared import keys as K
from shared.protocol import Task, Trajectory, decode
from shared.records import read_records, step_records
from shared.redis_replies import range_entries
from shared.run_config import RunConfig
from streamrl.bench.packing import packing_benchmark
from streamrl.bench.pipeline_report import (
    REAL_RUN_ATTEMPTS,
    Latencies,
    PipelineResults,
    RealRun,
    ScenarioFacts,
    ScenarioResults,
    lag_run,
    render_pipeline,
)
from streamrl.bench.pipeline_sim import GATEWAY_WORKERS, GatewayReport, SimBackend, spawn
from streamrl.bench.report import save
from streamrl.bench.schedule import (
    LAGS,
    MEASURE_FROM_STEP,
    SCENARIOS,
    Scenario,
    ideal_run,
    long_run_speedups,
    pipeline_figures,
)
from streamrl.bench.sleep_env import ENV_NAME
from streamrl.redis_server import RedisServer


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
            "max_infra_failure_fraction": None,  # rollouts without a model call are placeholders: not a failure here
            "async_grpo": {"max_trajectory_age_steps": lag},
        },
        "env": {"name": ENV_NAME},
        "checkpointing": {"enabled": False},
        "refit": {"probe_tokens": 0},  # no model, no tokenizer: nothing to score
        "logger": {"plot": False},
        "trainer": {"refit_timeout_s": 60.0, "startup_timeout_s": 120.0, "data_timeout_s": 600.0},
    }
    cfg = msgspec.convert(tree, RunConfig)
    cfg.check()
    return cfg


class Observed:
    """What the benchmark's hooks into the control plane note: when each group's tasks were
    published and when the trainer read each trajectory (wall times)."""

    def __init__(self) -> None:
        self.issued_at: dict[int, float] = {}  # group sequence number -> wall time its tasks were published
        self.received_at: dict[str, float] = {}  # task id -> wall time the trainer read its trajectory

    def tasks_issued(self, tasks: list[Task]) -> None:
        now = time.time()
        self.issued_at.update((int(t.group_id[-7:]), now) for t in tasks)  # ids end in the 7-digit sequence

    def trajectory_read(self, traj: Trajectory) -> None:
        self.received_at[traj.task_id] = time.time()


async def _train(cfg: RunConfig, backend: SimBackend, observed: Observed) -> tuple[ControlPlane, list[Trajectory]]:
    """Run the real control plane to the end with ``backend`` as its learner's; it and the run's
    trajectories (read back from the stream)."""
    hooks = TrainerHooks(tasks_issued=observed.tasks_issued, trajectory_read=observed.trajectory_read)
    control = ControlPlane(
        cfg, LocalLearner(lambda: backend), worker_id="trainer-sim", url="http://trainer.sim", hooks=hooks
    )
    await control.open()
    try:
        await control.run()
        entries = range_entries(await control.redis.xrange(control.keys.trajectories))
    finally:
        await control.aclose()
    return control, [decode(fields[K.ENTRY_FIELD], Trajectory) for _, fields in entries]


def rollout_latencies(trajs: list[Trajectory], issued_at: dict[int, float], received_at: dict[str, float]) -> Latencies:
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
    return Latencies(
        pickup_mean_s=statistics.mean(pickup),
        pickup_max_s=max(pickup),
        open_mean_s=statistics.mean(opening),
        open_max_s=max(opening),
        delivery_mean_s=statistics.mean(delivery),
        delivery_max_s=max(delivery),
        last_start_mean_s=statistics.mean(last_start.values()),
    )


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


def _run_with_helpers(
    cfg: RunConfig, scenario: Scenario, work: Path
) -> tuple[ControlPlane, list[Trajectory], SimBackend, Observed]:
    """The control plane run to its end, the generator stand-in and the gateway workers in a
    process each (started here, ending with the run)."""
    (work / "config.json").write_bytes(msgspec.json.encode(cfg))
    (work / "scenario.json").write_text(json.dumps(asdict(scenario)))
    helpers = [spawn("generator", work), spawn("gateway", work)]
    try:
        backend, observed = SimBackend(scenario.train_s), Observed()
        trainer, trajs = asyncio.run(_train(cfg, backend, observed))
    finally:
        for p in helpers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(10)
    if any(p.returncode for p in helpers):
        raise RuntimeError(f"a helper process failed; see {work}/generator.log and {work}/gateway.log")
    return trainer, trajs, backend, observed


def real_run(scenario: Scenario, lag: int, redis_url: str, work: Path, server_pid: int | None = None) -> RealRun:
    """One run of the real trainer (this process) against the generator stand-in and the gateway
    workers. ``other_cpu_cores``: the CPU other processes of the host used meanwhile (the Valkey
    server counts as ours when its pid is given)."""
    wall0, host0, own0 = time.monotonic(), host_busy_cpu_s(), own_cpu_s(server_pid)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run_id = f"pipeline-{scenario.name}-lag{lag}-{uuid.uuid4().hex[:6]}"
    cfg = run_config(scenario, lag, redis_url=redis_url, run_id=run_id, work=work)
    trainer, trajs, backend, observed = _run_with_helpers(cfg, scenario, work)
    other_cpu = (host_busy_cpu_s() - host0) - (own_cpu_s(server_pid) - own0)
    wall = time.monotonic() - wall0
    gateway = msgspec.json.decode((work / "gateway.report.json").read_bytes(), type=GatewayReport)
    measured = step_records(read_records(work / "out" / "metrics.jsonl"))[MEASURE_FROM_STEP + 1 :]
    starts, ends = [s for s, _ in backend.spans], [e for _, e in backend.spans]
    gaps = [b - a for a, b in zip(ends[MEASURE_FROM_STEP:-1], starts[MEASURE_FROM_STEP + 1 :], strict=True)]
    window = pipeline_figures(starts, ends)
    lat = rollout_latencies(trajs, observed.issued_at, observed.received_at)
    mean_refit_s = statistics.mean(r.refit.total_s for r in measured)
    mean_wait_data_s = statistics.mean(r.timing.wait_data_s for r in measured)
    return RealRun(
        steps_per_hour=window.steps_per_hour,
        busy_fraction=window.busy_fraction,
        issued_groups=trainer.scheduler.issued_total,
        evicted_groups=trainer.buffer.evicted_total,
        peak_rollouts=gateway.peak_rollouts,
        mean_gap_s=statistics.mean(gaps),
        mean_refit_s=mean_refit_s,
        max_refit_s=max(r.refit.total_s for r in measured),
        mean_wait_data_s=mean_wait_data_s,
        other_gap_s=statistics.mean(gaps) - mean_refit_s - mean_wait_data_s,
        latencies=lat,
        max_train_overshoot_s=max(e - b for b, e in backend.spans) - scenario.train_s,
        other_cpu_cores=other_cpu / wall,
        run_wall_s=wall,
    )


def scenario_facts(s: Scenario) -> ScenarioFacts:
    draws = [d for p in range(200) for d in s.durations(p, 0)]
    return ScenarioFacts(
        name=s.name,
        description=s.description,
        rollout_median_s=s.rollout_median_s,
        sigma=s.sigma,
        p99_over_p50=s.p99_over_p50,
        sampled_p99_over_p50=float(np.quantile(draws, 0.99) / np.quantile(draws, 0.5)),
        makespan_over_train=s.makespan_over_train,
        train_s=s.train_s,
        steps=s.steps,
        num_prompts=s.num_prompts,
        group_size=s.group_size,
        target_lag=s.target_lag,
        target_speedup=s.target_speedup,
    )


def measured_run(scenario: Scenario, lag: int, redis_url: str, work: Path, server_pid: int | None) -> RealRun:
    """`real_run`, repeated (up to REAL_RUN_ATTEMPTS) while it was disturbed (`RealRun.contended`):
    other processes of the host took more than CONTENDED_OTHER_CPU cores, or a training sleep
    overshot by more than CONTENDED_OVERSHOOT_S (the trainer could not get a core). Such a run
    measures the host as much as the pipeline. The least disturbed attempt is kept, with the number
    of attempts."""
    attempts: list[RealRun] = []
    while len(attempts) < REAL_RUN_ATTEMPTS:
        attempts.append(real_run(scenario, lag, redis_url, work, server_pid))
        if not attempts[-1].contended:
            break
    best = min(attempts, key=lambda r: (r.contended, r.other_cpu_cores))
    return msgspec.structs.replace(best, attempts=len(attempts))


def _scenario(s: Scenario, redis_url: str, work_dir: Path, server_pid: int | None) -> ScenarioResults:
    """A scenario at every lag, real and ideal."""
    long_run = long_run_speedups(s)
    measured = {
        lag: (measured_run(s, lag, redis_url, work_dir / f"{s.name}-lag{lag}", server_pid), ideal_run(s, lag))
        for lag in LAGS
    }
    runs = [lag_run(lag, real, ideal, measured[0], long_run[lag]) for lag, (real, ideal) in measured.items()]
    return ScenarioResults(scenario_facts(s), runs)


def run_pipeline_benchmark(
    work_dir: Path = Path("runs/bench/pipeline"),
    redis_url: str | None = None,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
) -> PipelineResults:
    """Every scenario at every lag, real and ideal, plus the packing figures. Starts its own
    Valkey unless ``redis_url`` is given."""
    date = time.strftime("%Y-%m-%d")
    server = None
    server_pid: int | None = None  # our own Valkey's, for the CPU accounting of the runs
    if redis_url is None:
        server = RedisServer(work_dir / "redis")
        server.start()
        redis_url = server.url
        server_pid = server.proc.pid if server.proc is not None else None
    try:
        results = [_scenario(s, redis_url, work_dir, server_pid) for s in scenarios]
    finally:
        if server is not None:
            server.stop()
    return PipelineResults(
        date=date,
        machine=f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        measure_from_step=MEASURE_FROM_STEP,
        gateway_workers=GATEWAY_WORKERS,
        gateway_slots_per_worker=RunConfig().gym_gateway.max_concurrent_rollouts,
        scenarios=results,
        packing=packing_benchmark(),
    )


def main(argv: list[str] | None = None) -> PipelineResults:
    ap = argparse.ArgumentParser(prog="python -m streamrl.bench.pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("runs/bench/pipeline"))
    ap.add_argument("--out", type=Path, help="also write the markdown section here")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    results = run_pipeline_benchmark(args.work_dir)
    text = render_pipeline(results)
    if args.out:
        args.out.write_text(text)
    if args.json:
        save(args.json, results)
    print(text)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

"""The autoscaling section of ``streamrl bench``: a run that sizes itself against fixed worker
counts, with rollouts that take twice as long from halfway through the run.

The pipeline benchmark's harness (`streamrl.bench.pipeline`): the real trainer control plane in
this process with the simulated training backend (a step sleeps TRAIN_S), rollouts that sleep a
seeded log-normal time and call no model (`streamrl.bench.sleep_env`), the same durations in every
run. Here the gateway workers limit throughput: each is a process of its own
(`streamrl.bench.autoscale_sim`) with SLOTS rollout slots, members of a real `WorkerPool` driven
by the real `ScaleChannel`, exactly as under ``streamrl up``. The autoscaled run turns
``autoscale.enabled`` on with the ``local`` backend, so its decisions go through the same channel
``streamrl scale`` uses: new workers are processes that start and join, removed ones drain.

Runs, one after the other on one Valkey: every fixed gateway count of FIXED_COUNTS, and the
autoscaled run starting at START_COUNT (bounds 1..MAX_COUNT). Steps per hour and the trainer's
busy fraction over the measured window (from the end of training of step MEASURE_FROM_STEP to the
end of the last step), and the time-weighted mean of ready gateway workers (what the run paid for).
Targets: the autoscaled run within 5% of the best fixed count's steps per hour, and at least 1.3x
the starting count's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis

from shared import keys as K
from shared.protocol import RunFile, write_run_file
from shared.records import autoscale_records, read_records, step_records
from shared.run_config import RunConfig
from streamrl.bench.report import Results, render, save
from streamrl.bench.schedule import MEASURE_FROM_STEP, Scenario, pipeline_figures
from streamrl.redis_server import RedisServer, free_port
from streamrl.supervisor import Child
from streamrl.worker_pool import ScaleChannel, WorkerPool

TRAIN_S = 2.0
STEPS = 40
SLOTS = 4  # rollout slots per gateway worker
SLOWDOWN = 2.0  # rollouts take this much longer from halfway through the run
START_COUNT = 2
MAX_COUNT = 8
FIXED_COUNTS = (2, 3, 4, 5, 6, 8)
TICK_S = 0.1
TARGET_OF_BEST = 0.95
TARGET_OVER_START = 1.3

SCENARIO = Scenario(
    name="doubling",
    description="rollout times double halfway through the run",
    sigma=0.25,
    makespan_over_train=0.4148,  # a rollout's median 0.5 s, then 1.0 s
    train_s=TRAIN_S,
    num_prompts=8,
    group_size=4,
    steps=STEPS,
    seed=11,
    target_lag=1,
    target_speedup=1.0,
)


class Decision(msgspec.Struct):
    step: int  # the step it followed
    at_s: float  # from the run's start
    before: int
    after: int
    reason: str
    apply_s: float
    outcome: str


class CountRun(msgspec.Struct):
    name: str
    autoscaled: bool
    start_count: int
    end_count: int
    steps_per_hour: float
    busy_fraction: float
    mean_workers: float  # time-weighted mean of ready gateway workers over the measured window
    wait_data_s: float  # mean per measured step
    counts: list[tuple[float, int]]  # (seconds from the run's start, ready gateways), at every change
    decisions: list[Decision]
    run_wall_s: float


class AutoscaleResults(Results):
    date: str
    machine: str
    steps: int
    train_s: float
    slots: int
    rollout_median_s: float
    slowdown: float
    max_count: int
    runs: list[CountRun]
    best_fixed: str
    of_best: float  # autoscaled steps per hour / best fixed
    over_start: float  # autoscaled / the starting count's
    section_s: float


def _config(work: Path, redis_url: str, count: int, autoscaled: bool, scenario: Scenario) -> RunConfig:
    from streamrl.bench.pipeline import run_config  # the trainer's control plane: heavy

    run_id = f"autoscale-{'auto' if autoscaled else count}-{uuid.uuid4().hex[:6]}"
    cfg = run_config(scenario, 1, redis_url=redis_url, run_id=run_id, work=work)
    tree = msgspec.to_builtins(cfg)
    tree["gym_gateway"].update(num_workers=count, max_concurrent_rollouts=SLOTS, drain_timeout_s=30.0)
    tree["autoscale"].update(
        enabled=autoscaled,
        backend="local",
        generator={"min": 1, "max": 1},
        gym_gateway={"min": 1, "max": MAX_COUNT},
        request_timeout_s=60.0,
    )
    out = msgspec.convert(tree, RunConfig)
    out.check()
    return out


class Pools:
    """The generator and the gateway workers as `streamrl up` keeps them: pools ticked by a thread
    through the scale channel, which the autoscaler's local backend talks to."""

    def __init__(self, cfg: RunConfig, work: Path) -> None:
        self.cfg, self.work = cfg, work
        self.keys = K.RunKeys(cfg.run.run_id)
        self.pools = {
            "generator": WorkerPool("generator", self._child("generator"), stop_timeout_s=10.0, ready_timeout_s=60.0),
            "gym-gateway": WorkerPool("gym-gateway", self._child("gateway"), stop_timeout_s=40.0, ready_timeout_s=60.0),
        }
        assert cfg.redis.url
        self.redis = redis.Redis.from_url(cfg.redis.url)
        self.channel = ScaleChannel(self.redis, self.keys, self.pools)
        self.counts: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="pools", daemon=True)

    def _child(self, role: str) -> Callable[[int], Child]:
        def make(index: int) -> Child:
            port = free_port()
            return Child(
                name=f"{role}-{index}",
                args=[
                    "-m",
                    "streamrl.bench.autoscale_sim",
                    role,
                    str(self.work / "config.json"),
                    str(self.work / "scenario.json"),
                    str(port),
                    f"{role}-{index}",
                ],
                log_path=self.work / "logs" / f"{role}-{index}.log",
                port=port,
            )

        return make

    def start(self) -> None:
        """The initial members, ready, then the ticking thread."""
        self.pools["generator"].start_initial(self.cfg.generator.num_workers)
        self.pools["gym-gateway"].start_initial(self.cfg.gym_gateway.num_workers)
        deadline = time.monotonic() + 120.0
        while any(p.counts()["ready"] < p.target for p in self.pools.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark's workers did not start; see {self.work}/logs")
            self.channel.tick()
            time.sleep(TICK_S)
        self._thread.start()

    def _tick(self) -> None:
        last = -1
        while not self._stop.is_set():
            self.channel.tick()
            ready = self.pools["gym-gateway"].counts()["ready"]
            if ready != last:
                self.counts.append((time.time(), ready))
                last = ready
            time.sleep(TICK_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for pool in self.pools.values():
            for child in pool.children():
                child.stop(45.0)
        self.redis.close()


def run_one(work: Path, redis_url: str, count: int, autoscaled: bool, scenario: Scenario = SCENARIO) -> CountRun:
    """One run to its end: the real control plane here, the workers in their pools; rollouts take
    SLOWDOWN x longer from the scenario's halfway step on."""
    from services.trainer.control_plane import ControlPlane
    from services.trainer.learner import LocalLearner
    from streamrl.bench.pipeline_sim import SimBackend

    shutil.rmtree(work, ignore_errors=True)
    (work / "out").mkdir(parents=True)
    cfg = _config(work, redis_url, count, autoscaled, scenario)
    (work / "config.json").write_bytes(msgspec.json.encode(cfg))
    slow_from = (scenario.steps // 2) * scenario.num_prompts  # rows are issued in order: the second half's
    (work / "scenario.json").write_text(
        json.dumps({"scenario": msgspec.to_builtins(scenario), "slowdown": SLOWDOWN, "slowdown_from_prompt": slow_from})
    )
    # What `streamrl up` writes for `streamrl scale` (and the autoscaler's local backend) to find the run.
    write_run_file(work / "out", RunFile(run_id=cfg.run.run_id, trainer_url="http://trainer.sim", redis_url=redis_url))
    pools = Pools(cfg, work)
    backend = SimBackend(TRAIN_S)
    t0 = time.time()
    pools.start()
    try:
        control = ControlPlane(cfg, LocalLearner(lambda: backend), worker_id="trainer-sim", url="http://trainer.sim")

        async def train() -> None:
            await control.open()
            try:
                await control.run()
            finally:
                await control.aclose()

        asyncio.run(train())
    finally:
        pools.stop()
    wall = time.time() - t0
    starts, ends = [s for s, _ in backend.spans], [e for _, e in backend.spans]
    window = pipeline_figures(starts, ends)
    records = read_records(work / "out" / "metrics.jsonl")
    measured = step_records(records)[MEASURE_FROM_STEP + 1 :]
    # the window in wall time: from the end of training of MEASURE_FROM_STEP to the end of the last step
    w_end = time.time() - (time.perf_counter() - ends[-1])
    w_start = w_end - window.window_s
    return CountRun(
        name="autoscaled" if autoscaled else f"fixed {count}",
        autoscaled=autoscaled,
        start_count=count,
        end_count=pools.counts[-1][1] if pools.counts else count,
        steps_per_hour=window.steps_per_hour,
        busy_fraction=window.busy_fraction,
        mean_workers=time_weighted(pools.counts, w_start, w_end),
        wait_data_s=sum(r.timing.wait_data_s for r in measured) / max(len(measured), 1),
        counts=[(round(t - t0, 2), n) for t, n in pools.counts],
        decisions=[
            Decision(d.step - 1, round(d.time - t0, 2), d.before, d.after, d.reason, d.apply_s, d.outcome)
            for d in autoscale_records(records)
            if d.role == "gym_gateway"
        ],
        run_wall_s=wall,
    )


def time_weighted(counts: list[tuple[float, int]], start: float, end: float) -> float:
    """The mean of a step function given as (time, value) changes, over [start, end]."""
    total, value = 0.0, counts[0][1] if counts else 0
    at = start
    for t, n in counts:
        if t <= start:
            value = n
            continue
        if t >= end:
            break
        total += value * (t - at)
        at, value = t, n
    total += value * (end - at)
    return total / (end - start) if end > start else float(value)


def autoscale_benchmark(work_dir: Path, machine: str, redis_url: str | None = None) -> AutoscaleResults:
    t0 = time.monotonic()
    server = None
    if redis_url is None:
        server = RedisServer(work_dir / "redis")
        server.start()
        redis_url = server.url
    try:
        runs = [run_one(work_dir / "auto", redis_url, START_COUNT, autoscaled=True)]
        runs += [run_one(work_dir / f"fixed-{n}", redis_url, n, autoscaled=False) for n in FIXED_COUNTS]
    finally:
        if server is not None:
            server.stop()
    auto = runs[0]
    fixed = [r for r in runs if not r.autoscaled]
    best = max(fixed, key=lambda r: r.steps_per_hour)
    start = next(r for r in fixed if r.start_count == START_COUNT)
    return AutoscaleResults(
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        steps=STEPS,
        train_s=TRAIN_S,
        slots=SLOTS,
        rollout_median_s=SCENARIO.rollout_median_s,
        slowdown=SLOWDOWN,
        max_count=MAX_COUNT,
        runs=runs,
        best_fixed=best.name,
        of_best=auto.steps_per_hour / best.steps_per_hour,
        over_start=auto.steps_per_hour / start.steps_per_hour,
        section_s=time.monotonic() - t0,
    )


def render_section(r: AutoscaleResults) -> str:
    return render(
        "autoscale",
        r=r,
        start=START_COUNT,
        target_of_best=TARGET_OF_BEST,
        target_over_start=TARGET_OVER_START,
        met=r.of_best >= TARGET_OF_BEST and r.over_start >= TARGET_OVER_START,
    )


def main(argv: list[str] | None = None) -> AutoscaleResults:
    ap = argparse.ArgumentParser(prog="python -m streamrl.bench.autoscale", description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("runs/bench/autoscale"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    results = autoscale_benchmark(args.work_dir, machine)
    if args.json:
        save(args.json, results)
    print(render_section(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

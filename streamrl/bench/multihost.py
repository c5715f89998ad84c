"""Beyond one host: the demo across simulated hosts (`streamrl.bench.hosts`) against the same run
on one host, side by side in one run.

Every layout is the same run started the same way (`streamrl.bench.cluster_run`: each role with
``streamrl join``), the demo's config shortened to STEPS steps with the collective (resharding)
transport and two trainer ranks:
  * one host: every role on h0, the trainer's two ranks on that node (torchrun standalone);
  * four hosts: Valkey and the trainer's first node on h0, its second node on h1, the generator on
    h2, the gateway worker on h3, links unshaped (the namespaces' veth pairs);
  * four hosts at RATE_MBIT: the same, each host's link shaped to RATE_MBIT in each direction.
Per layout: median step time, training time and refit time over the steps after WARMUP, and each
host's link bytes per step (its interface counters). The target is set from the per-byte cost:
crossing hosts may add at most TARGET_FACTOR x the time the busiest link needs for a step's bytes
at its rate (measured as the shaped layout's wire time), to the step and, for the generator's link,
to the refit. This kernel has no netem, so links are shaped in rate only (no added latency).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import time
from pathlib import Path

import msgspec

from shared.records import read_records, step_records
from streamrl.bench.report import Results, render

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
WARMUP = 2
RATE_MBIT = 100.0
TARGET_FACTOR = 1.5
HOSTS = ("h0", "h1", "h2", "h3")
ROLES = {"h0": "Valkey, trainer node 0", "h1": "trainer node 1", "h2": "generator", "h3": "gateway worker"}


class HostBytes(msgspec.Struct):
    host: str
    roles: str
    rx_per_step: float
    tx_per_step: float


class LayoutRun(msgspec.Struct):
    name: str
    rate_mbit: float | None  # None: unshaped
    steps: int
    step_s: float  # medians over the steps after WARMUP
    train_s: float
    wait_data_s: float
    refit_s: float
    refit_bytes: int
    reward_first: float
    reward_last: float
    links: list[HostBytes]
    run_s: float


class MultihostResults(Results):
    date: str
    machine: str
    load_avg_start: float
    model: str
    layouts: list[LayoutRun]
    section_s: float


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_layout(work: Path, prepared: Path, name: str, spread: bool, rate_mbit: float | None) -> LayoutRun:
    from streamrl.bench.cluster_run import ClusterRun, demo_overrides, link_bytes
    from streamrl.bench.hosts import SimCluster

    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")  # a folder and a run id
    out = work / slug / "run"
    shutil.rmtree(out.parent, ignore_errors=True)
    shutil.copytree(prepared, out)
    overrides = [*demo_overrides(out, f"bench-{slug}", STEPS), f"run.output_dir={out}", "refit.transport=collective"]
    if spread:
        overrides += ["trainer.nnodes=2", "trainer.rdzv_endpoint=h0:29400"]
    else:
        overrides += ["trainer.nproc_per_node=2"]
    t0 = time.perf_counter()
    with SimCluster(HOSTS) as cluster:
        if rate_mbit is not None:
            for h in HOSTS:
                cluster[h].shape(rate_mbit)
        run = ClusterRun(cluster, ROOT / "deploy" / "configs" / "demo.yaml", out, overrides)
        try:
            run.start_redis("h0")
            where = {"trainer": ["h0", "h1"], "generator": ["h2"], "gym-gateway": ["h3"]}
            if not spread:
                where = {"trainer": ["h0"], "generator": ["h0"], "gym-gateway": ["h0"]}
            for role in ("generator", "gym-gateway", "trainer"):
                for h in where[role]:
                    run.join(h, role)
            before = {h: link_bytes(cluster[h]) for h in HOSTS}
            code = run.wait("h0", "trainer", 1800)
            after = {h: link_bytes(cluster[h]) for h in HOSTS}
            if code != 0:
                raise RuntimeError(f"layout {name}: the trainer exited {code}:\n{run.logs()}")
        finally:
            run.stop()
    steps = step_records(read_records(out / "metrics.jsonl"))
    timed = steps[WARMUP:]
    refits = [s.refit for s in timed]
    rewards = [s.batch.reward_mean for s in steps]
    return LayoutRun(
        name=name,
        rate_mbit=rate_mbit,
        steps=len(steps),
        step_s=_median([s.timing.step_s for s in timed]),
        train_s=_median([s.timing.train_s for s in timed]),
        wait_data_s=_median([s.timing.wait_data_s for s in timed]),
        refit_s=_median([r.total_s for r in refits]),
        refit_bytes=int(_median([float(r.num_bytes) for r in refits])),
        reward_first=statistics.mean(rewards[:3]),
        reward_last=statistics.mean(rewards[-3:]),
        links=[
            HostBytes(
                host=h,
                roles=ROLES[h] if spread else ("every role" if h == "h0" else "-"),
                rx_per_step=(after[h][0] - before[h][0]) / max(1, len(steps)),
                tx_per_step=(after[h][1] - before[h][1]) / max(1, len(steps)),
            )
            for h in HOSTS
        ],
        run_s=time.perf_counter() - t0,
    )


def multihost_benchmark(work: Path, machine: str) -> MultihostResults:
    from streamrl.demo import prepare

    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0, la = time.perf_counter(), os.getloadavg()[0]
    prepared = work / "prepared"
    shutil.rmtree(prepared, ignore_errors=True)
    prepare(prepared)
    layouts = [
        run_layout(work, prepared, "one host", False, None),
        run_layout(work, prepared, "four hosts", True, None),
        run_layout(work, prepared, f"four hosts at {RATE_MBIT:.0f} Mbit/s", True, RATE_MBIT),
    ]
    return MultihostResults(
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        load_avg_start=la,
        model="tiny Qwen3, 1.0M parameters, float32",
        layouts=layouts,
        section_s=time.perf_counter() - t0,
    )


def wire_s(nbytes: float, rate_mbit: float) -> float:
    return nbytes * 8 / (rate_mbit * 1e6)


def verdicts(r: MultihostResults) -> dict[str, float | bool]:
    """The figures the section's targets are judged on (see the module's docstring)."""
    one, shaped = r.layouts[0], r.layouts[-1]
    rate = shaped.rate_mbit or RATE_MBIT
    busiest = max(max(h.rx_per_step, h.tx_per_step) for h in shaped.links)
    gen = next(h for h in shaped.links if h.host == "h2")
    step_wire, refit_wire = wire_s(busiest, rate), wire_s(gen.rx_per_step, rate)
    step_added, refit_added = shaped.step_s - one.step_s, shaped.refit_s - one.refit_s
    return {
        "step_wire_s": step_wire,
        "step_added_s": step_added,
        "step_met": step_added <= TARGET_FACTOR * step_wire,
        "refit_wire_s": refit_wire,
        "refit_added_s": refit_added,
        "refit_met": refit_added <= TARGET_FACTOR * refit_wire,
    }


def render_section(r: MultihostResults) -> str:
    return render("multihost", r=r, v=verdicts(r), steps=STEPS, warmup=WARMUP, factor=TARGET_FACTOR)

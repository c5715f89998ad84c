"""The reshard section of ``streamrl bench``: a refit without a gather (``refit.collective.method:
reshard``) against the gathering ``broadcast`` method and raw gloo point-to-point sends of the
plan's bytes, and what that predicts for the reference run.

For one Qwen3 model built at random (refit section's smallest size), bfloat16 on CPU, a trainer
of two ranks (torchrun, FSDP2) into two layouts: one vLLM generator of tensor parallel 2, and two
generators of one rank. Per layout and method, fresh generators (started on random weights) and
`streamrl.bench.reshard_worker` refitting them: one warm-up (it forms the group), then the median
of ``REFITS``. The raw baseline (``python -m streamrl.bench.reshard raw``, under torchrun, 2
senders + the layout's engine ranks): every link of the plan (`services.trainer.reshard_order`,
computed here offline as the trainer does) as one gloo isend/irecv of its bytes, all links at
once, median of ``RAW_REPEATS`` after a warm-up. Called by `streamrl.bench.suite`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from streamrl.bench.report import GIB, Results, render

ROOT = Path(__file__).resolve().parents[2]
REFITS = 3  # timed refits per method, after one warm-up
RAW_REPEATS = 5  # after one warm-up
BUCKET_MB = 256  # refit.collective.bucket_mb's default
TRAINER_RANKS = 2
LAYOUTS = ((2, 1), (1, 2))  # (engine ranks per generator, generators)
BANDWIDTH_TARGET = 0.8  # reshard bandwidth / raw p2p bandwidth
BALANCE_TARGET = 1.1  # busiest link / an even split of the plan's bytes over its links
# The reference run (Qwen3.5-397B-A17B, bf16) and its layouts, as in tests/unit/test_reshard_plan.py.
REF_GIB = 739.0
REF_ENGINES, REF_ENGINE_RANKS, REF_TRAINER_RANKS, REF_EXPERT_HOLDERS = 24, 8, 64, 8
REF_LINK_GIB_S = 40.0
NEMO_RL_S = (1.97, 2.17)


class Spread(msgspec.Struct):
    median: float
    min: float
    max: float


class LayoutRun(msgspec.Struct):
    model: str
    model_gib: float
    engine_ranks: int  # per generator
    generators: int
    reshard_s: Spread  # RefitReport.save_s: the whole transfer
    reshard_total_s: float  # publish to confirmed, median
    broadcast_s: Spread
    broadcast_total_s: float
    raw_s: Spread
    plan_bytes: int
    links: int
    busiest_link_bytes: int
    even_link_bytes: float
    balance: float  # busiest / even
    sender_balance: float  # the most any trainer rank sends / the plan's bytes over the trainer ranks
    receiver_balance: float  # the most any engine rank receives / the plan's bytes over the engine ranks
    bandwidth_ratio: float  # (plan bytes / reshard s) / (plan bytes / raw s)
    vs_broadcast: float  # broadcast s / reshard s
    slots: int
    slot_bytes: int
    load_avg: list[float]  # 1-min load average at the layout's start and end


class Reference(msgspec.Struct):
    busiest_link_gib: float
    per_sender_gib: float
    per_engine_rank_gib: float
    overhead: float  # measured reshard s / raw s, the worse layout
    link_bound_s: float
    sender_bound_s: float


class ReshardResults(Results):
    date: str
    machine: str
    load_avg_start: float
    bucket_mb: int
    refits: int
    raw_repeats: int
    layouts: list[LayoutRun]
    reference: Reference
    section_s: float


def _spread(xs: list[float]) -> Spread:
    return Spread(statistics.median(xs), min(xs), max(xs))


# -- the plan, offline ------------------------------------------------------------------------------


def plan_links(model_dir: Path, tp: int, generators: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """[(trainer rank, group rank, bytes)] of the plan into ``generators`` engines of ``tp``
    ranks (group ranks numbered as the transfer numbers them), and the order's slots, slot bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.trainer.reshard_order import EngineNeeds, reshard_order
    from services.trainer.reshard_source import FsdpShards
    from shared_torch.stored_names import stored_names

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch.bfloat16)
    skip = frozenset({"lm_head.weight"}) if model.config.tie_word_embeddings else frozenset()
    holdings = FsdpShards(model, TRAINER_RANKS, 0, skip).holdings()
    engine = EngineNeeds(str(model_dir), engine="vllm", tensor_parallel_size=tp, expert_parallel=False)
    engine.shapes = dict(stored_names(model, skip))
    members = [f"generator-{i}" for i in range(generators)]
    order, plan = reshard_order(
        holdings,
        engine,
        members,
        trainer_ranks=TRAINER_RANKS,
        dtype="bfloat16",
        itemsize=2,
        bucket_bytes=BUCKET_MB << 20,
        generator_info={},
    )
    rank = {m: i for i, m in enumerate(members)}
    links = [(s, TRAINER_RANKS + rank[d.generator] * tp + d.rank, n) for (s, d), n in plan.links().items()]
    return sorted(links), order.slots, order.slot_bytes


# -- the raw baseline (a worker under torchrun) -----------------------------------------------------


def raw_worker(links_json: Path, out: Path) -> None:
    """Every link at once as one gloo isend/irecv of its bytes; rank 0 writes the round times."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    me = dist.get_rank()
    links = json.loads(links_json.read_text())
    mine = [(s, d, torch.empty(n, dtype=torch.uint8)) for s, d, n in links if me in (s, d)]
    times = []
    for _ in range(RAW_REPEATS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(t, d) if s == me else dist.irecv(t, s) for s, d, t in mine]
        for w in works:
            w.wait()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if me == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def _torchrun(nproc: int, args: list[str], log: Path, timeout_s: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
    if code != 0:
        raise RuntimeError(f"torchrun {args[:3]} exited with {code}; see {log}")


def raw_p2p(work: Path, links: list[tuple[int, int, int]], world: int) -> list[float]:
    (work / "links.json").write_text(json.dumps(links))
    args = ["-m", "streamrl.bench.reshard", "raw", str(work / "links.json"), str(work / "raw.json")]
    _torchrun(world, args, work / "raw.log", 600)
    times: list[float] = json.loads((work / "raw.json").read_text())
    return times[1:]


# -- the refits ------------------------------------------------------------------------------------


def _config(work: Path, model_dir: Path, redis_url: str, run_id: str, tp: int, method: str) -> Path:
    import yaml

    from streamrl.bench.refit_worker import generator_config

    tree = generator_config(model_dir, redis_url, run_id, BUCKET_MB)
    tree["run"]["output_dir"] = str(work / "run")
    tree["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = tp
    tree["refit"]["collective"]["method"] = method
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def refits(work: Path, model_dir: Path, redis_url: str, tp: int, count: int, method: str) -> list[dict[str, float]]:
    """``REFITS + 1`` refits by ``method`` into ``count`` fresh generators of ``tp`` ranks."""
    from streamrl.child_guard import guarded
    from streamrl.redis_server import free_port

    work.mkdir(parents=True)
    run_id = f"bench-reshard-{method}-{tp}x{count}-{os.getpid()}-{int(time.time())}"
    config = _config(work, model_dir, redis_url, run_id, tp, method)
    gens = []
    try:
        for i in range(count):
            cmd = [sys.executable, "-m", "services.generator", "--config", str(config), "--port", str(free_port())]
            with open(work / f"generator-{i}.log", "wb") as f:
                gens.append(
                    subprocess.Popen(
                        guarded([*cmd, "--worker-id", f"generator-{i}"]),
                        cwd=ROOT,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        args = ["-m", "streamrl.bench.reshard_worker", "--config", str(config), "--generators", str(count)]
        args += ["--refits", str(REFITS + 1), "--out", str(work / "refits.json")]
        _torchrun(TRAINER_RANKS, args, work / "trainer.log", 900)
    finally:
        for g in gens:
            if g.poll() is None:
                g.terminate()
        for g in gens:
            try:
                g.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(g.pid, 9)
                g.wait()
    reports: list[dict[str, float]] = json.loads((work / "refits.json").read_text())["refits"]
    return reports[1:]


def _most(links: list[tuple[int, int, int]], end: int) -> int:
    """The most bytes through one end (0: trainer rank, 1: engine rank) of ``links``."""
    by: dict[int, int] = {}
    for link in links:
        by[link[end]] = by.get(link[end], 0) + link[2]
    return max(by.values())


def measure_layout(work: Path, model_dir: Path, name: str, redis_url: str, tp: int, count: int) -> LayoutRun:
    la0 = os.getloadavg()[0]
    work.mkdir(parents=True)
    links, slots, slot_bytes = plan_links(model_dir, tp, count)
    raw = raw_p2p(work, links, TRAINER_RANKS + tp * count)
    by = {m: refits(work / m, model_dir, redis_url, tp, count, m) for m in ("reshard", "broadcast")}
    total = sum(n for _, _, n in links)
    busiest, even = max(n for _, _, n in links), total / len(links)
    reshard, bcast = _spread([r["save_s"] for r in by["reshard"]]), _spread([r["save_s"] for r in by["broadcast"]])
    raw_s = _spread(raw)
    return LayoutRun(
        model=name,
        model_gib=total / count / GIB,  # the plan: the model once per generator (it logs the ratio)
        engine_ranks=tp,
        generators=count,
        reshard_s=reshard,
        reshard_total_s=statistics.median(r["total_s"] for r in by["reshard"]),
        broadcast_s=bcast,
        broadcast_total_s=statistics.median(r["total_s"] for r in by["broadcast"]),
        raw_s=raw_s,
        plan_bytes=total,
        links=len(links),
        busiest_link_bytes=busiest,
        even_link_bytes=even,
        balance=busiest / even,
        sender_balance=_most(links, 0) / (total / TRAINER_RANKS),
        receiver_balance=_most(links, 1) / (total / (tp * count)),
        bandwidth_ratio=raw_s.median / reshard.median,
        vs_broadcast=bcast.median / reshard.median,
        slots=slots,
        slot_bytes=slot_bytes,
        load_avg=[la0, os.getloadavg()[0]],
    )


def reference(overhead: float) -> Reference:
    """The reference run, analytically (see the section's prose for every assumption)."""
    per_engine_rank = REF_GIB / REF_ENGINE_RANKS
    busiest = per_engine_rank / REF_EXPERT_HOLDERS
    per_sender = REF_GIB * REF_ENGINES / REF_TRAINER_RANKS
    return Reference(
        busiest_link_gib=busiest,
        per_sender_gib=per_sender,
        per_engine_rank_gib=per_engine_rank,
        overhead=overhead,
        link_bound_s=busiest / REF_LINK_GIB_S * overhead,
        sender_bound_s=per_sender / REF_LINK_GIB_S * overhead,
    )


def reshard_benchmark(work: Path, redis_url: str, machine: str) -> ReshardResults:
    from streamrl.bench.refit import SIZES, num_params
    from streamrl.bench.refit_worker import build
    from streamrl.model_builder import build_tiny_model

    work = work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0, la = time.perf_counter(), os.getloadavg()[0]
    spec, model_dir = SIZES[0], work / "model"
    (work / "spec.json").write_bytes(msgspec.json.encode(spec))
    build(model_dir, work / "spec.json", build_tiny_model(work / "tokenizer"))  # the refit section's model
    name = f"{num_params(spec) / 1e6:.0f}M"
    layouts = [measure_layout(work / f"tp{tp}x{n}", model_dir, name, redis_url, tp, n) for tp, n in LAYOUTS]
    overhead = max(lay.reshard_s.median / lay.raw_s.median for lay in layouts)
    return ReshardResults(
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        load_avg_start=la,
        bucket_mb=BUCKET_MB,
        refits=REFITS,
        raw_repeats=RAW_REPEATS,
        layouts=layouts,
        reference=reference(overhead),
        section_s=time.perf_counter() - t0,
    )


def render_section(r: ReshardResults) -> str:
    return render(
        "reshard",
        r=r,
        bandwidth_target=BANDWIDTH_TARGET,
        balance_target=BALANCE_TARGET,
        ref_gib=REF_GIB,
        ref_engines=REF_ENGINES,
        ref_engine_ranks=REF_ENGINE_RANKS,
        ref_trainer_ranks=REF_TRAINER_RANKS,
        ref_expert_holders=REF_EXPERT_HOLDERS,
        link_gib_s=REF_LINK_GIB_S,
        nemo_rl_s=NEMO_RL_S,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["raw"]:
        raw_worker(Path(sys.argv[2]), Path(sys.argv[3]))

"""The refit section of ``streamrl bench``: what a weight version costs to publish, per transport,
against raw baselines of the same bytes, and what that predicts for a large run.

For Qwen3 models built at random (about 0.1, 0.5 and 2 GiB of bfloat16), in one run, one size at a
time, each part in its own processes (`streamrl.bench.refit_worker`), nothing else running:

1. Baseline B: ``safetensors`` ``save_file`` + ``load_file`` back of the model's tensors (page
   cache); sha256 and xxh3 rates over the same bytes; the trainer's float32 -> bfloat16 cast alone.
2. Baseline A: a raw ``torch.distributed`` gloo broadcast of the same bytes, same buckets.
3. `WeightPublisher.refit` from the trainer's learner to one vLLM generator service process,
   filesystem and collective alternated on the same generator, publish to confirmed.

Then `extrapolate` scales the measured per-byte costs of the largest size to the reference run (a
model, stated with every assumption, next to published figures of other systems), and
`render_section` writes the BENCHMARKS.md section. Called by `streamrl.bench`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from streamrl.bench.refit_worker import SETTLE_S
from streamrl.model_builder import TinyModelSpec

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Refit"
COLLECTIVE_TARGET = 0.8  # collective bandwidth over raw broadcast bandwidth, largest size
FILESYSTEM_TARGET = 1.5  # filesystem refit time over raw save_file + load_file, largest size
REFITS = 3  # timed refits per transport, after one warm-up each
BUCKET_MB = 256  # refit.collective.bucket_mb's default
GIB = 2**30

# (hidden, intermediate, layers, attention heads, kv heads, head_dim): about 0.1, 0.5 and 2 GiB of bfloat16
_SHAPES = ((512, 1536, 8, 8, 4, 64), (1024, 3072, 16, 16, 8, 64), (2048, 6144, 19, 16, 8, 128))
SIZES = tuple(
    TinyModelSpec(
        vocab_size=32768,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d,
        max_position_embeddings=4096,
    )
    for h, i, n, heads, kv, d in _SHAPES
)


def num_params(spec: TinyModelSpec) -> int:
    """Parameters of the untied Qwen3 of ``spec`` (embeddings, lm_head, layers with q/k norms)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * spec.num_attention_heads * d * 2 + h * spec.num_key_value_heads * d * 2 + 2 * d
    layer = attn + 3 * h * spec.intermediate_size + 2 * h
    return 2 * spec.vocab_size * h + spec.num_hidden_layers * layer + h


# -- running the parts -----------------------------------------------------------------------------


class MemoryPeak:
    """Peak host memory in use (MemTotal - MemAvailable, every process on the host) while open."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memory-peak")

    @staticmethod
    def in_use() -> tuple[int, int]:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self.in_use()[0])

    def __enter__(self) -> MemoryPeak:
        self.peak = self.in_use()[0]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_worker(mode: str, model: Path, out: Path, args: list[str]) -> dict[str, Any]:
    """``streamrl.bench.refit_worker`` (``broadcast`` under torchrun, two ranks); its JSON result."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if mode == "broadcast" else []
    cmd = [sys.executable, *launcher, "-m", "streamrl.bench.refit_worker", mode, str(model), str(out), *args]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"refit bench worker {mode!r} exited with {code}; see {log}")
    result: dict[str, Any] = msgspec.json.decode(out.read_bytes())
    return result


def measure_size(work: Path, spec: TinyModelSpec, tokenizer: Path, redis_url: str) -> dict[str, Any]:
    """The three parts for one model size; raw results."""
    work.mkdir(parents=True)
    model, name = work / "model", f"{num_params(spec) / 1e6:.0f}M"
    (work / "spec.json").write_bytes(msgspec.json.encode(spec))
    prep = ["--spec", str(work / "spec.json"), "--tokenizer", str(tokenizer)]
    prepare = run_worker("prepare", model, work / "prepare.json", prep)
    bcast = run_worker("broadcast", model, work / "broadcast.json", ["--bucket-mb", str(BUCKET_MB)])
    with MemoryPeak() as mem:
        refit_args = ["--redis", redis_url, "--refits", str(REFITS), "--bucket-mb", str(BUCKET_MB)]
        refit = run_worker("refit", model, work / "refit.json", refit_args)
    shutil.rmtree(model, ignore_errors=True)
    return {
        "name": name,
        "params": num_params(spec),
        "spec": asdict(spec),
        "prepare": prepare,
        "broadcast": bcast,
        "refit": refit,
        "peak_memory_bytes": mem.peak,
    }


def refit_benchmark(work: Path, redis_url: str, machine: str) -> dict[str, Any]:
    """Every size (see the module docstring); a JSON-able dict for `render_section`."""
    from streamrl.model_builder import build_tiny_model

    work = work.resolve()  # the workers run in the repository root
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    tokenizer = build_tiny_model(work / "tokenizer")  # its tokenizer files go with every model
    sizes = [measure_size(work / f"size{i}", spec, tokenizer, redis_url) for i, spec in enumerate(SIZES)]
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "cores": os.cpu_count() or 1,
        "memory_bytes": MemoryPeak.in_use()[1],
        "refits": REFITS,
        "bucket_mb": BUCKET_MB,
        "sizes": sizes,
        "section_s": time.perf_counter() - t0,
    }


# -- figures ---------------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def figures(size: dict[str, Any]) -> dict[str, Any]:
    """One size's medians (timed refits only), baselines and the ratios the targets name."""
    timed = [r for r in size["refit"]["refits"] if not r["warm_up"]]
    out: dict[str, Any] = {"name": size["name"], "peak_memory_bytes": size["peak_memory_bytes"]}
    for transport in ("filesystem", "collective"):
        rs = [r for r in timed if r["transport"] == transport]
        out[transport] = {
            "total": _spread([r["total_s"] for r in rs]),
            **{k: statistics.median(r[k] for r in rs) for k in ("save_s", "confirm_s", "load_s", "num_bytes")},
            "n": len(rs),
        }
    prep, bcast = size["prepare"], size["broadcast"]
    coll, fs = out["collective"], out["filesystem"]
    out["num_bytes"] = coll["num_bytes"]
    out["broadcast_s"], out["broadcast_bytes"] = bcast["s"], bcast["num_bytes"]
    out["write_read_s"], out["save_file_s"], out["load_file_s"] = prep["total_s"], prep["save_s"], prep["load_s"]
    out["cast_s"], out["hash_gib_s"] = prep["cast_s"], prep["hash_gib_s"]
    # bandwidth ratio: bytes over time on each side (the same bytes, both from the parameter list)
    out["collective_ratio"] = (coll["num_bytes"] / coll["total"]["median"]) / (bcast["num_bytes"] / bcast["s"])
    out["filesystem_ratio"] = fs["total"]["median"] / prep["total_s"]
    base_load = [r["load_avg"] for r in prep["rounds"][1:]] + [bcast["load_avg"]]
    refit_load = [r["load_avg"] for r in timed]
    out["load_avg"] = {"refits": [min(refit_load), max(refit_load)], "baselines": [min(base_load), max(base_load)]}
    return out


# -- the reference run, modelled -------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """The run the extrapolation is for, and the hardware it assumes (assumptions, not measured)."""

    params: float = 397e9  # Qwen3.5-397B-A17B
    bytes_per_param: int = 2  # bfloat16
    trainer_ranks: int = 64
    generators: int = 24
    gpus_per_generator: int = 8  # 92.5 GiB of weights per GPU: an 8-GPU H200-class node per engine
    network_gib_s: float = 40.0  # NCCL broadcast over one 400 Gb/s InfiniBand NIC per GPU
    parallel_fs_gib_s: float = 100.0  # aggregate parallel-filesystem bandwidth, reads or writes

    @property
    def num_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Modelled:
    """One row of the extrapolation: what, how it is modelled, seconds (a range when ``hi_s`` is set),
    and whether the seconds are a published figure rather than our model."""

    name: str
    how: str
    lo_s: float | None
    hi_s: float | None = None
    published: bool = False


def extrapolate(fig: dict[str, Any], ref: Reference | None = None) -> list[Modelled]:
    """The measured per-byte costs of ``fig`` (the largest size) scaled to ``ref`` (default:
    `Reference`); published figures of other systems last."""
    ref = ref or Reference()
    b, gib = ref.num_bytes, ref.num_bytes / GIB
    fs, coll = fig["filesystem"], fig["collective"]
    write_rate = fs["num_bytes"] / fs["save_s"] / GIB  # one trainer rank's export, GiB/s
    load_rate = fs["num_bytes"] / fs["load_s"] / GIB  # one generator's verify + reload, GiB/s
    write_s = max(b / ref.trainer_ranks / GIB / write_rate, gib / ref.parallel_fs_gib_s)
    read_s = max(gib / load_rate, ref.generators * gib / ref.parallel_fs_gib_s)
    wire_s = gib / ref.network_gib_s
    overhead = coll["total"]["median"] / fig["broadcast_s"]
    overhead_on_gpu = max(1.0, (coll["total"]["median"] - fig["cast_s"]) / fig["broadcast_s"])
    sha = fig["hash_gib_s"]["sha256"]
    per_gpu_gib = gib / ref.gpus_per_generator
    return [
        Modelled(
            "filesystem (ours)",
            f"each of {ref.trainer_ranks} ranks writes 1/{ref.trainer_ranks} ({gib / ref.trainer_ranks:.1f} GiB) "
            f"at the measured {write_rate:.2f} GiB/s ({write_s:.0f} s), then each generator verifies and loads the "
            f"whole model at the measured {load_rate:.2f} GiB/s ({gib / load_rate:.0f} s; {ref.generators} "
            f"generators reading at once need {ref.generators * gib / ref.parallel_fs_gib_s:.0f} s of a "
            f"{ref.parallel_fs_gib_s:.0f} GiB/s parallel filesystem)",
            write_s + read_s,
        ),
        Modelled(
            "collective (ours), as measured",
            f"{gib:.0f} GiB cross one broadcast to every generator once at {ref.network_gib_s:.0f} GiB/s "
            f"({wire_s:.1f} s), times our measured overhead over the raw broadcast ({overhead:.1f}x)",
            wire_s * overhead,
        ),
        Modelled(
            "collective (ours), cast on the GPU",
            f"as above without the trainer's one-thread CPU cast ({fig['cast_s']:.1f} s of the measured "
            f"{coll['total']['median']:.1f} s; on GPUs it runs on the device): overhead {overhead_on_gpu:.1f}x",
            wire_s * overhead_on_gpu,
        ),
        Modelled(
            "+ engine checksums (`verify_engine_checksums: true`)",
            f"vLLM's sha256 over each GPU's {per_gpu_gib:.1f} GiB at the measured {sha:.2f} GiB/s, after the "
            "transfer (not in the measured overhead: on CPU vLLM hashes its linear weights as empty tensors)",
            per_gpu_gib / sha,
        ),
        Modelled(
            "sha256-based refit (this project before)",
            f"sha256 of {gib:.0f} GiB at the measured {sha:.2f} GiB/s on each side (trainer, then generator), "
            "single-threaded, on top of moving the bytes",
            2 * gib / sha,
        ),
        Modelled("NeMo-RL `nccl_reshard`", "published: Qwen3.5-397B on H100s", 2.0, published=True),
        Modelled("Moonshot checkpoint-engine", "published: Kimi-K2 (1T, FP8) on 256 H20s", 16.0, published=True),
        Modelled(
            "verl delta sync",
            f"published: sends 1-3% of the bf16 bytes; modelled here at {ref.network_gib_s:.0f} GiB/s",
            0.01 * wire_s,
            0.03 * wire_s,
        ),
    ]


# -- the section -----------------------------------------------------------------------------------


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def render_section(r: dict[str, Any]) -> str:
    """The BENCHMARKS.md section for the results of `refit_benchmark`."""
    figs = [figures(s) for s in r["sizes"]]
    big = figs[-1]
    lines = [
        f"{HEADING} (`streamrl bench --only refit`: trainer learner to one vLLM generator process, bfloat16, "
        f"on CPU; {r['date']}, {r['machine']})",
        "",
        "Qwen3 models built at random, published in bfloat16 (`policy.precision: bfloat16`: 2 bytes per "
        "parameter; the learner keeps float32 master weights and trains with one torch thread; the filesystem "
        "export casts with every core (`weight_export.refit_threads`), the collective sender with the training's "
        "one). vLLM runs in bfloat16 on this CPU. Per size: `WeightPublisher.refit` from a `LocalLearner` (torch "
        "backend, one rank) to one `python -m services.generator` process, publish to confirmed "
        "(`RefitReport.total_s`), the filesystem (files of at most 512 MiB) and the collective transport (gloo, "
        f"`bucket_mb: {r['bucket_mb']}`) alternated on the same generator, {SETTLE_S:.0f} s apart (a training "
        "step stands there in a run; vLLM's engine processes busy-poll a core for a second after each call they "
        "answer, and the filesystem transport removes the version before last in the background: neither "
        "belongs to the next refit), one warm-up each (the collective one forms the transfer group and writes "
        f"its snapshot), then the median of {r['refits']} each (range in brackets). Baselines, measured in "
        "separate processes just "
        "before: raw broadcast = `torch.distributed` gloo broadcast of the same bytes in the same buckets "
        "between two processes (median of 5); raw write+read = `safetensors` `save_file` of the same tensors "
        "to a fresh file and `load_file` back into them (page cache, median of 5).",
        "",
        "| model | published GiB | filesystem s | collective s | raw broadcast s (GiB/s) | raw write+read s | "
        "collective bw / raw broadcast bw | filesystem / raw write+read | 1-min load average: refits; baselines |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        fs, coll = f["filesystem"]["total"], f["collective"]["total"]
        (r_lo, r_hi), (b_lo, b_hi) = f["load_avg"]["refits"], f["load_avg"]["baselines"]
        lines.append(
            f"| {f['name']} | {f['num_bytes'] / GIB:.2f} | {fs['median']:.2f} ({fs['min']:.2f}-{fs['max']:.2f}) | "
            f"{coll['median']:.2f} ({coll['min']:.2f}-{coll['max']:.2f}) | {f['broadcast_s']:.2f} "
            f"({f['broadcast_bytes'] / GIB / f['broadcast_s']:.2f}) | {f['write_read_s']:.2f} | "
            f"{f['collective_ratio']:.2f} | {f['filesystem_ratio']:.2f} | "
            f"{r_lo:.1f}-{r_hi:.1f}; {b_lo:.1f}-{b_hi:.1f} |"
        )
    fs, coll = big["filesystem"], big["collective"]
    lines += [
        "",
        f"Targets at the largest size ({big['num_bytes'] / GIB:.2f} GiB): collective bandwidth / raw broadcast "
        f">= {COLLECTIVE_TARGET}: {_met(big['collective_ratio'] >= COLLECTIVE_TARGET)} "
        f"({big['collective_ratio']:.2f}); filesystem / raw write+read <= {FILESYSTEM_TARGET}: "
        f"{_met(big['filesystem_ratio'] <= FILESYSTEM_TARGET)} ({big['filesystem_ratio']:.2f}).",
        "",
        f"Where the time goes at {big['num_bytes'] / GIB:.2f} GiB (medians, s):",
        "",
        "| phase | filesystem | collective |",
        "|---|---|---|",
        f"| moving the bytes (`RefitReport.save_s`; filesystem: the learner's export, cast + serialize + hash + "
        f"write; collective: the whole transfer into the engine) | {fs['save_s']:.2f} | {coll['save_s']:.2f} |",
        f"| then until confirmed (`confirm_s`: announce, generator, ack; the old versions are removed in the "
        f"background) | {fs['confirm_s']:.2f} | "
        f"{coll['confirm_s']:.2f} |",
        f"| the generator's `load_s` from its ack (filesystem: verify digests + reload + cache reset; collective: "
        f"receive while the trainer sends + engine checksums + reset) | {fs['load_s']:.2f} | {coll['load_s']:.2f} |",
        f"| of the trainer's part: the float32 -> bfloat16 cast alone into fresh memory, one thread (measured "
        f"apart) | "
        f"{big['cast_s']:.2f} | {big['cast_s']:.2f} |",
        f"| baselines: `save_file` / `load_file` back; raw broadcast | {big['save_file_s']:.2f} / "
        f"{big['load_file_s']:.2f} | {big['broadcast_s']:.2f} |",
        "",
        f"What still separates the transports from their baselines at this size. Collective: the generator paces "
        f"the transfer (its `load_s`, {coll['load_s']:.2f} s, is nearly the whole refit): vLLM's layer-wise reload "
        "of each bucket (materialize the layer, load it, repack the linear weights for oneDNN, copy back) costs "
        "several times the bucket's time on the wire on this CPU, and while the worker loads, vLLM's engine core "
        f"busy-polls for its answer on one of the {r['cores']} cores the trainer and the worker share; the raw "
        "broadcast neither loads nor casts. Filesystem: the trainer's cast from float32 (no baseline casts) and vLLM's "
        f"reload ({fs['load_s']:.2f} s with the digest checks, against `load_file`'s {big['load_file_s']:.2f} s).",
        "",
        "Generator bring-up, process start to `/ready` (s), each start alone on the host with the model's files "
        "in the page cache, reading the checkpoint (`load_format: auto`) vs on random weights (`dummy`, the "
        "collective transport's default: the trainer's first refit brings the weights): "
        + "; ".join(
            f"{s['name']} {s['refit']['bring_up_s']['auto']:.1f} vs {s['refit']['bring_up_s']['dummy']:.1f}"
            for s in r["sizes"]
            if "bring_up_s" in s["refit"]
        )
        + ". On this host the page cache serves the checkpoint about as fast as vLLM fills random weights; the "
        "dummy start is for clusters, where each engine would otherwise read the whole model from shared "
        "storage before the first refit sends it again.",
        "",
        f"Hash rates over the same bytes, one thread: sha256 {big['hash_gib_s']['sha256']:.2f} GiB/s, xxh3-128 "
        f"{big['hash_gib_s']['xxh3_128']:.2f} GiB/s. Host memory in use at the peak of the largest size's "
        f"refits (every process on the host): {big['peak_memory_bytes'] / GIB:.1f} of "
        f"{r['memory_bytes'] / GIB:.1f} GiB{_larger(big['peak_memory_bytes'], r['memory_bytes'])}.",
        "",
        *_render_model(big),
        "",
        f"The section took {r['section_s'] / 60:.1f} min, model builds and process starts included.",
        "",
    ]
    return "\n".join(lines)


def _larger(peak_bytes: int, total_bytes: int) -> str:
    return ": a model twice as large would not fit, so none was run" if 2 * peak_bytes > total_bytes else ""


def _render_model(big: dict[str, Any]) -> list[str]:
    ref = Reference()
    lines = [
        f"**A model, not a measurement:** the reference run (Qwen3.5-397B-A17B: {ref.params / 1e9:.0f}e9 "
        f"parameters, bf16 = {ref.num_bytes / GIB:.0f} GiB; {ref.trainer_ranks} trainer GPUs, {ref.generators} "
        f"generator engines of {ref.gpus_per_generator} GPUs) from the per-byte costs measured above at "
        f"{big['num_bytes'] / GIB:.2f} GiB. Assumed: a {ref.network_gib_s:.0f} GiB/s NCCL broadcast, a "
        f"{ref.parallel_fs_gib_s:.0f} GiB/s parallel filesystem, the CPU rates of this machine for everything "
        "measured per process, and the trainer's gathers overlapping the transfer. Published figures of other "
        "systems are quoted as published.",
        "",
        "| refit of the reference run | how | time |",
        "|---|---|---|",
    ]
    for m in extrapolate(big, ref):
        when = _s(m.lo_s) if m.hi_s is None else f"{_s(m.lo_s)}-{_s(m.hi_s)}"
        lines.append(f"| {m.name} | {m.how} | {when} ({'published' if m.published else 'model'}) |")
    return lines

"""The refit section of ``streamrl bench``: what a weight version costs to publish, per transport,
against raw baselines of the same bytes, and what that predicts for a large run.

For Qwen3 models built at random (about 0.1, 0.5 and 2 GiB of bfloat16), in one run, one size at a
time, each part in its own processes (`streamrl.bench.refit_worker`), nothing else running:

1. Baseline B: ``safetensors`` ``save_file`` + ``load_file`` back of the model's tensors (page
   cache); sha256 and xxh3 rates over the same bytes; the trainer's float32 -> bfloat16 cast alone.
2. Baseline A: a raw ``torch.distributed`` gloo broadcast of the same bytes, same buckets.
3. `WeightPublisher.refit` from the trainer's learner to one vLLM generator service process,
   filesystem and collective alternated on the same generator, publish to confirmed.

Then `streamrl.bench.refit_results` takes each size's figures and scales the measured per-byte
costs of the largest size to the reference run (a model, stated with every assumption, next to
published figures of other systems) into the section's `RefitResults`, rendered by
``templates/refit.md.jinja``. Called by `streamrl.bench.suite`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TypeVar

import msgspec

from streamrl.bench.refit_results import RefitResults, summarize
from streamrl.bench.refit_runs import Broadcast, Prepared, Refits, SizeRun
from streamrl.bench.refit_worker import BASELINE_REPEATS, SETTLE_S
from streamrl.bench.report import render
from streamrl.model_builder import TinyModelSpec

ROOT = Path(__file__).resolve().parents[2]
COLLECTIVE_TARGET = 0.8  # collective bandwidth over raw broadcast bandwidth, largest size
FILESYSTEM_TARGET = 1.5  # filesystem refit time over raw save_file + load_file, largest size
REFITS = 3  # timed refits per transport, after one warm-up each
BUCKET_MB = 256  # refit.collective.bucket_mb's default
T = TypeVar("T")

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


def run_worker(mode: str, model: Path, out: Path, args: list[str], kind: type[T]) -> T:
    """``streamrl.bench.refit_worker`` (``broadcast`` under torchrun, two ranks); what it wrote."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if mode == "broadcast" else []
    cmd = [sys.executable, *launcher, "-m", "streamrl.bench.refit_worker", mode, str(model), str(out), *args]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"refit bench worker {mode!r} exited with {code}; see {log}")
    return msgspec.json.decode(out.read_bytes(), type=kind)


def measure_size(work: Path, spec: TinyModelSpec, tokenizer: Path, redis_url: str) -> SizeRun:
    """The three parts for one model size."""
    work.mkdir(parents=True)
    model, name = work / "model", f"{num_params(spec) / 1e6:.0f}M"
    (work / "spec.json").write_bytes(msgspec.json.encode(spec))
    prep = ["--spec", str(work / "spec.json"), "--tokenizer", str(tokenizer)]
    prepare = run_worker("prepare", model, work / "prepare.json", prep, Prepared)
    bcast = run_worker("broadcast", model, work / "broadcast.json", ["--bucket-mb", str(BUCKET_MB)], Broadcast)
    with MemoryPeak() as mem:
        refit_args = ["--redis", redis_url, "--refits", str(REFITS), "--bucket-mb", str(BUCKET_MB)]
        refit = run_worker("refit", model, work / "refit.json", refit_args, Refits)
    shutil.rmtree(model, ignore_errors=True)
    return SizeRun(name, num_params(spec), prepare, bcast, refit, mem.peak)


def refit_benchmark(work: Path, redis_url: str, machine: str) -> RefitResults:
    """Every size (see the module docstring)."""
    from streamrl.model_builder import build_tiny_model

    work = work.resolve()  # the workers run in the repository root
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    tokenizer = build_tiny_model(work / "tokenizer")  # its tokenizer files go with every model
    sizes = [measure_size(work / f"size{i}", spec, tokenizer, redis_url) for i, spec in enumerate(SIZES)]
    return summarize(
        sizes,
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        cores=os.cpu_count() or 1,
        memory_bytes=MemoryPeak.in_use()[1],
        refits=REFITS,
        bucket_mb=BUCKET_MB,
        section_s=time.perf_counter() - t0,
    )


def render_section(r: RefitResults) -> str:
    return render(
        "refit",
        r=r,
        settle_s=SETTLE_S,
        baseline_repeats=BASELINE_REPEATS,
        collective_target=COLLECTIVE_TARGET,
        filesystem_target=FILESYSTEM_TARGET,
    )

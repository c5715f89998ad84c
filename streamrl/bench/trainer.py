"""The trainer section of ``streamrl bench``: what the torch backend costs over plain torch, and
what a second rank buys, on CPU.

Two Qwen3-architecture models are built at random in the section's folder (nothing is
downloaded): a small one for throughput, and one of tens of millions of parameters, large enough
that parameters, gradients and optimizer state dominate, for memory and checkpoints. Each part
runs in worker processes (`streamrl.bench.trainer_worker`); every ratio compares two sides
measured in the same process, alternated step by step (A B, B A, ...) after a warm-up step each,
so that load from other processes hits both:

1. Throughput at one rank: `Backend.train_step` against a bare loop (the same model, batch,
   clipped importance-corrected GRPO token loss and AdamW, written plainly in torch).
2. Two ranks (torchrun, gloo, one thread each): the learner over both ranks as the trainer runs
   it against a one-rank learner with one thread.
3. Memory: bytes of each rank's parameters, gradients and optimizer state (local shards) after
   one step at two ranks, against one rank.
4. Checkpoints at two ranks: how long `save_checkpoint` blocks, synchronous against asynchronous
   (``checkpointing.async_save``), and how long until the asynchronous one is on disk.
5. The megatron backend (when megatron-core is installed): against the same bare loop at one rank
   (alternated in one process), and its layouts at two ranks (tensor, data, pipeline and, on a
   Qwen3-MoE, expert parallelism) against one rank, each run alone in its own processes one after
   the other, with the training state rank 0 holds.

`trainer_benchmark` returns the section's `TrainerResults` (`streamrl.bench.trainer_results`),
rendered by ``templates/trainer.md.jinja``. Called by `streamrl.bench.suite`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from streamrl.bench.report import render
from streamrl.bench.trainer_results import (
    LayoutRun,
    Losses,
    Megatron,
    TrainerResults,
    WorkerOut,
    checkpoints,
    load_range,
    loading,
    megatron_figures,
    memory,
    paired,
)
from streamrl.model_builder import TinyModelSpec, qwen3_config

ROOT = Path(__file__).resolve().parents[2]
THROUGHPUT_TARGET = 0.9  # backend tokens/s over the bare loop's
MEMORY_TARGET = 0.55  # training state per rank at 2 ranks over 1 rank
WORLD_SIZE = 2
ROUNDS = 10  # alternated steps per side, throughput and scaling
SAVES = 3  # synchronous and asynchronous saves each, after one warm-up of each
# Throughput: 16 rows (4 groups of 4) of 32-128 tokens; memory and checkpoints: 4 short rows.
THROUGHPUT_ROWS = ["--rows", "16", "--min-len", "32", "--max-len", "128"]
STATE_ROWS = ["--rows", "4", "--min-len", "32", "--max-len", "64"]
SMALL = TinyModelSpec(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    head_dim=64,
    max_position_embeddings=4096,
)
LARGE = TinyModelSpec(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)


def build_model(out: Path, spec: TinyModelSpec, dtype: str = "float32") -> int:
    """A randomly initialised Qwen3 causal LM of ``spec``'s shape saved to ``out`` in ``dtype``
    (weights and config, no tokenizer: the trainer reads token ids); its parameter count."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(qwen3_config(spec, spec.vocab_size, pad_id=0, bos_id=0, eos_id=1))
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def run_worker(mode: str, model: Path, out: Path, args: list[str], world_size: int = 1) -> WorkerOut:
    """``streamrl.bench.trainer_worker`` alone or under torchrun; what rank 0 wrote."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"] if world_size > 1 else []
    )
    cmd = [sys.executable, *launcher, "-m", "streamrl.bench.trainer_worker", mode, str(model), str(out), *args]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"trainer bench worker {mode!r} exited with {code}; see {log}")
    return msgspec.json.decode(out.read_bytes(), type=WorkerOut)


def trainer_benchmark(work: Path, machine: str) -> TrainerResults:
    """The parts of the module docstring, each in worker processes."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    small, large = work / "small-qwen3", work / "large-qwen3"
    small_params, large_params = build_model(small, SMALL), build_model(large, LARGE)
    rounds = ["--rounds", str(ROUNDS)]
    compare = run_worker("compare", small, work / "compare.json", [*rounds, "--threads", "1", *THROUGHPUT_ROWS])
    scale = run_worker("scale", small, work / "scale.json", [*rounds, *THROUGHPUT_ROWS], WORLD_SIZE)
    state = run_worker("state", large, work / "state.json", ["--saves", str(SAVES), *STATE_ROWS], WORLD_SIZE)
    build_model(large_bf16 := work / "large-qwen3-bf16", LARGE, "bfloat16")  # as checkpoints are published
    whole, shards = (
        run_worker("load", large_bf16, work / f"load-{how}.json", flags, WORLD_SIZE).builds
        for how, flags in (("whole", ["--whole"]), ("shards", []))
    )
    megatron = megatron_part(work, small) if importlib.util.find_spec("megatron") is not None else None
    assert compare.backend_loss is not None and compare.bare_loss is not None and state.single is not None
    return TrainerResults(
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        cores=os.cpu_count() or 1,
        world_size=WORLD_SIZE,
        small_params_m=small_params / 1e6,
        large_params_m=large_params / 1e6,
        tokens=compare.tokens,
        rounds=ROUNDS,
        first_loss=Losses(compare.backend_loss, compare.bare_loss),
        throughput=paired(compare.rounds, compare.tokens),
        scaling=paired(scale.rounds, scale.tokens),
        load_avg_throughput=load_range(compare.rounds),
        load_avg_scaling=load_range(scale.rounds),
        memory=memory(state.single, state.ranks),
        checkpoint=checkpoints(state.saves),
        loading=loading(whole, shards),
        megatron=megatron,
        section_s=time.perf_counter() - t0,
    )


MEGATRON = ["--set", "trainer.backend=megatron"]
# A Qwen3-MoE of the small model's width: 8 experts, top 2.
MOE_SHAPE: dict[str, int] = {
    "vocab_size": SMALL.vocab_size,
    "hidden_size": SMALL.hidden_size,
    "num_hidden_layers": SMALL.num_hidden_layers,
    "head_dim": SMALL.head_dim,
    "num_experts": 8,
    "moe_intermediate_size": SMALL.intermediate_size // 2,
    "intermediate_size": SMALL.intermediate_size,
}


def megatron_part(work: Path, small: Path) -> Megatron:
    """Part 5 (see the module docstring)."""
    moe = work / "small-qwen3-moe"
    code = f"from streamrl.model_builder import build_tiny_moe; build_tiny_moe({str(moe)!r}, **{MOE_SHAPE!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    rounds = ["--rounds", str(ROUNDS), *THROUGHPUT_ROWS]
    compare = run_worker("compare", small, work / "megatron-compare.json", [*rounds, "--threads", "1", *MEGATRON])
    layouts = {
        "dense, 1 rank": (small, [], 1),
        "dense, tensor parallel 2": (small, ["--set", "policy.megatron_cfg.tensor_model_parallel_size=2"], 2),
        "dense, data parallel 2": (small, [], 2),
        "dense, data parallel 2, distributed optimizer": (
            small,
            ["--set", "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"],
            2,
        ),
        "dense, pipeline parallel 2": (small, ["--set", "policy.megatron_cfg.pipeline_model_parallel_size=2"], 2),
        "MoE, 1 rank": (moe, [], 1),
        "MoE, expert parallel 2": (moe, ["--set", "policy.megatron_cfg.expert_model_parallel_size=2"], 2),
    }
    runs = {}
    for i, (name, (model, flags, world)) in enumerate(layouts.items()):
        r = run_worker("alone", model, work / f"megatron-{i}.json", [*rounds, *MEGATRON, *flags], world)
        assert r.state is not None  # alone mode reports rank 0's state
        runs[name] = LayoutRun(r.tokens / statistics.median(r.step_s), r.state.total, r.load_avg)
    return megatron_figures(compare, runs)


def render_section(r: TrainerResults) -> str:
    return render("trainer", r=r, throughput_target=THROUGHPUT_TARGET, memory_target=MEMORY_TARGET, moe=MOE_SHAPE)

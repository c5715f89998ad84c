"""The trainer section of ``streamrl bench``: what the torch backend costs over plain torch, and
what a second rank buys, on CPU.

Two Qwen3-architecture models are built at random in the section's folder (nothing is
downloaded): a small one for throughput, and one of tens of millions of parameters, large enough
that parameters, gradients and optimizer state dominate, for memory and checkpoints. Each part
runs in worker processes (`streamrl.bench.trainer_worker`); every ratio compares two sides
measured in the same process, alternated step by step (A B, B A, ...) after a warm-up step each,
so that load from other processes hits both:

1. Throughput at one rank: `TorchBackend.train_step` against a bare loop (the same model, batch,
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

`render_section` writes the BENCHMARKS.md section. Called by `streamrl.bench`.
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
from typing import Any

from streamrl.model_builder import TinyModelSpec, qwen3_config

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Trainer"
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


def run_worker(mode: str, model: Path, out: Path, args: list[str], world_size: int = 1) -> dict[str, Any]:
    """``streamrl.bench.trainer_worker`` alone or under torchrun; its JSON result."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"] if world_size > 1 else []
    )
    cmd = [sys.executable, *launcher, "-m", "streamrl.bench.trainer_worker", mode, str(model), str(out), *args]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"trainer bench worker {mode!r} exited with {code}; see {log}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def paired(rounds: list[dict[str, float]], side: str, base: str, tokens: int) -> dict[str, float]:
    """Tokens/s of each side (tokens over its median step time) and side/base as the median of the
    rounds' ratios of throughput, with their range."""
    ratios = [r[f"{base}_s"] / r[f"{side}_s"] for r in rounds]
    return {
        "tok_s": tokens / statistics.median(r[f"{side}_s"] for r in rounds),
        "base_tok_s": tokens / statistics.median(r[f"{base}_s"] for r in rounds),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def memory(state: dict[str, Any]) -> dict[str, Any]:
    """Bytes of training state at one rank and per rank at many (the largest rank's), by kind."""
    kinds = ("params", "grads", "optimizer")
    single = {k: state["single"][k] for k in kinds}
    per_rank = {k: max(r[k] for r in state["ranks"]) for k in kinds}
    return {
        "single": {**single, "total": sum(single.values())},
        "per_rank": {**per_rank, "total": max(sum(r[k] for k in kinds) for r in state["ranks"])},
    }


def checkpoints(saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timed (not warm-up) saves, synchronous and asynchronous."""
    out: dict[str, Any] = {}
    for name, is_async in (("sync", False), ("async", True)):
        timed = [s for s in saves if s["async"] == is_async and not s["warm_up"]]
        out[name] = {k: statistics.median(s[k] for s in timed) for k in ("blocking_s", "on_disk_s", "num_bytes")}
        out[name]["n"] = len(timed)
    return out


def trainer_benchmark(work: Path, machine: str) -> dict[str, Any]:
    """The four parts (see the module docstring); a JSON-able dict for `render_section`."""
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
    loading = {
        how: run_worker("load", large_bf16, work / f"load-{how}.json", flags, WORLD_SIZE)["ranks"]
        for how, flags in (("whole", ["--whole"]), ("shards", []))
    }
    return {
        "megatron": megatron_part(work, small) if _has_megatron() else None,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "cores": os.cpu_count() or 1,
        "world_size": WORLD_SIZE,
        "small_params": small_params,
        "large_params": large_params,
        "tokens": compare["tokens"],
        "rounds": ROUNDS,
        "throughput": paired(compare["rounds"], "backend", "bare", compare["tokens"]),
        "first_loss": {"backend": compare["backend_loss"], "bare": compare["bare_loss"]},
        "scaling": paired(scale["rounds"], "ranked", "single", scale["tokens"]),
        "memory": memory(state),
        "checkpoint": checkpoints(state["saves"]),
        "loading": loading,
        "load_avg": {
            name: _range([r["load_avg"] for r in w["rounds"]])
            for name, w in (("throughput", compare), ("scaling", scale))
        },
        "section_s": time.perf_counter() - t0,
        "raw": {"compare": compare, "scale": scale, "state": state},
    }


def _has_megatron() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None


MEGATRON = ["--set", "trainer.backend=megatron"]
# A Qwen3-MoE of the small model's width: 8 experts, top 2.
MOE_SHAPE: dict[str, Any] = {
    "vocab_size": SMALL.vocab_size,
    "hidden_size": SMALL.hidden_size,
    "num_hidden_layers": SMALL.num_hidden_layers,
    "head_dim": SMALL.head_dim,
    "num_experts": 8,
    "moe_intermediate_size": SMALL.intermediate_size // 2,
    "intermediate_size": SMALL.intermediate_size,
}


def megatron_part(work: Path, small: Path) -> dict[str, Any]:
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
    alone = {
        name: run_worker("alone", model, work / f"megatron-{i}.json", [*rounds, *MEGATRON, *flags], world)
        for i, (name, (model, flags, world)) in enumerate(layouts.items())
    }
    return {
        "tokens": compare["tokens"],
        "throughput": paired(compare["rounds"], "backend", "bare", compare["tokens"]),
        "first_loss": {"backend": compare["backend_loss"], "bare": compare["bare_loss"]},
        "layouts": {
            name: {
                "tok_s": r["tokens"] / statistics.median(r["step_s"]),
                "state": sum(r["state"].values()),
                "load_avg": r["load_avg"],
            }
            for name, r in alone.items()
        },
    }


def _megatron_lines(t: dict[str, Any]) -> list[str]:
    m = t.get("megatron")
    if not m:
        return []
    tp, lay = m["throughput"], m["layouts"]
    base = {"dense": lay["dense, 1 rank"], "MoE": lay["MoE, 1 rank"]}
    lines = [
        "The megatron backend (megatron-core GPTModel, its DDP, CPU ranks over gloo) on the same throughput model "
        f"and batch. Against the bare loop it is alternated step by step in one process as above (first losses "
        f"{m['first_loss']['backend']:.6f} and {m['first_loss']['bare']:.6f}). Its layouts at two ranks run "
        "as the trainer runs them (torchrun, `RankedLearner`), each alone in processes of its own, one after the "
        f"other, {t['rounds']} timed steps after a warm-up step, against the one-rank run of the same model: not "
        "side by side, so load from other processes moves these ratios more than the alternated ones. The MoE "
        f"is a Qwen3-MoE of the same width with {MOE_SHAPE['num_experts']} experts (top 2). Training state: the "
        "bytes of rank 0's parameters, gradients and AdamW state (its parts), float32. Tensor parallelism halves "
        "the split layers' state; data parallelism keeps every replica's, unless the distributed optimizer "
        "shards AdamW's state over the data ranks (`policy.megatron_cfg.optimizer.use_distributed_optimizer`; "
        "parameters and gradients stay whole). Pipeline stages each hold half the layers (rank 0: the first "
        "half and the embedding) and run megatron-core's one-forward-one-backward schedule over the step's "
        "micro-batches: with 2 stages and m micro-batches an update idles each stage for about 1/(m+1) of it "
        "(the pipeline bubble).",
        "",
        "| megatron backend | tokens/s | baseline tokens/s | ratio | training state per rank / 1 rank |",
        "|---|---|---|---|---|",
        f"| against the bare torch loop, 1 rank | {tp['tok_s']:.0f} | {tp['base_tok_s']:.0f} | {tp['ratio']:.2f} "
        f"({tp['ratio_min']:.2f}-{tp['ratio_max']:.2f}) | |",
    ]
    for name, r in lay.items():
        if "1 rank" in name:
            continue
        b = base["MoE" if name.startswith("MoE") else "dense"]
        lines.append(
            f"| {name} against 1 rank | {r['tok_s']:.0f} | {b['tok_s']:.0f} | {r['tok_s'] / b['tok_s']:.2f} | "
            f"{r['state'] / b['state']:.2f} |"
        )
    return [*lines, ""]


def _range(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _loading_lines(t: dict[str, Any]) -> list[str]:
    """Building the policy at many ranks: the whole checkpoint on every rank against each rank
    reading its own shards (the largest rank's figures)."""
    loading = t.get("loading")
    if not loading:
        return []
    worst = {how: {k: max(r[k] or 0 for r in ranks) for k in ranks[0]} for how, ranks in loading.items()}
    w, sh = worst["whole"], worst["shards"]
    return [
        f"| building the policy at {t['world_size']} ranks, same model from a bfloat16 checkpoint (float32 master "
        "weights) | peak private memory growth (MiB) | checkpoint bytes read (MiB) | seconds |",
        "|---|---|---|---|",
        f"| the whole checkpoint loaded on every rank, then sharded | {w['peak_growth'] / 2**20:.0f} | whole file "
        f"| {w['seconds']:.1f} |",
        f"| each rank reads its own rows (`services.trainer.sharded_load`) | {sh['peak_growth'] / 2**20:.0f} | "
        f"{sh['bytes_read'] / 2**20:.0f} | {sh['seconds']:.1f} |",
        f"| own rows / whole | {sh['peak_growth'] / max(w['peak_growth'], 1):.2f} | | "
        f"{sh['seconds'] / w['seconds']:.2f} |",
        "",
        "Per rank, the largest of the ranks: the growth of its peak private (anonymous) memory while the backend "
        "builds the policy, sampled every 2 ms (each way in fresh processes). Pages of the checkpoint file "
        "mapped for reading are the page cache's, shared by the node's ranks, and not counted. Loaded whole, "
        "every rank first holds the whole model cast to float32; reading its own rows, only its shards.",
        "",
    ]


def render_section(t: dict[str, Any]) -> str:
    """The BENCHMARKS.md section for the results of `trainer_benchmark`."""
    tp, sc, mem, ck = t["throughput"], t["scaling"], t["memory"], t["checkpoint"]
    ws, load = t["world_size"], t["load_avg"]
    mem_ratio = mem["per_rank"]["total"] / mem["single"]["total"]
    best = min(ws, t["cores"])  # ranks beyond the cores share them
    lines = [
        f"{HEADING} (`streamrl bench --only trainer`: torch backend on CPU, Qwen3 models built at random; "
        f"{t['date']}, {t['machine']})",
        "",
        f"Throughput on a {t['small_params'] / 1e6:.1f}M-parameter Qwen3, one step = one AdamW update over 16 rows "
        f"(4 groups of 4, 32-128 tokens, {t['tokens']:,} tokens, half of each row generated) in micro-batches of "
        "4 rows padded to their longest, float32, one torch thread per process (with two, a step stalls whenever "
        "another process holds one of the cores). Each comparison runs both sides in one process (rank 0's), one "
        f"warm-up step each, then {t['rounds']} steps each alternated step by step (A B, B A, ...); tokens/s "
        "divide the step's tokens by the median step time, the ratio is the median of the steps' ratios (range "
        "in brackets). The bare loop is the same model, batch, micro-batches, clipped importance-corrected GRPO "
        "token loss, gradient clipping and AdamW written plainly in torch; its first step's loss is "
        f"{t['first_loss']['bare']:.6f} against the backend's {t['first_loss']['backend']:.6f}. At {ws} ranks the "
        "learner runs as the trainer runs it under torchrun (`RankedLearner` on rank 0, `follow` on rank 1, FSDP2 "
        "over gloo, `trainer.torch_threads=1` per rank); its baseline is a one-rank learner (`LocalLearner`) in "
        f"rank 0 while rank 1 waits idle. Scaling here is bounded by the host's {t['cores']} cores: {ws} ranks can "
        f"at best reach {best:.0f}x one rank's tokens/s, and less while other processes take a core. The 1-minute load "
        f"average ranged {load['throughput'][0]:.1f}-{load['throughput'][1]:.1f} over the first comparison's steps "
        f"and {load['scaling'][0]:.1f}-{load['scaling'][1]:.1f} over the second's (one-rank figures of the two rows "
        "differ with it).",
        "",
        "| comparison | tokens/s | baseline tokens/s | ratio (range) | target |",
        "|---|---|---|---|---|",
        f"| `TorchBackend.train_step` against the bare torch loop, 1 rank | {tp['tok_s']:.0f} | "
        f"{tp['base_tok_s']:.0f} | {tp['ratio']:.2f} ({tp['ratio_min']:.2f}-{tp['ratio_max']:.2f}) | "
        f">= {THROUGHPUT_TARGET}: {_met(tp['ratio'] >= THROUGHPUT_TARGET)} |",
        f"| {ws} ranks against 1 rank | {sc['tok_s']:.0f} | {sc['base_tok_s']:.0f} | "
        f"{sc['ratio']:.2f} ({sc['ratio_min']:.2f}-{sc['ratio_max']:.2f}) | none (at most {best:.1f} on "
        f"{t['cores']} cores) |",
        "",
        f"Training state on a {t['large_params'] / 1e6:.1f}M-parameter Qwen3 after one step: bytes of the "
        "parameters, gradients and AdamW state each rank holds (a DTensor's local shard), float32.",
        "",
        f"| training state | 1 rank (MiB) | per rank at {ws} ranks (MiB) | per rank / 1 rank |",
        "|---|---|---|---|",
    ]
    for kind, label in (
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer", "AdamW state"),
        ("total", "total"),
    ):
        one, each = mem["single"][kind], mem["per_rank"][kind]
        lines.append(f"| {label} | {one / 2**20:.1f} | {each / 2**20:.1f} | {each / one:.2f} |")
    sync, asyn = ck["sync"], ck["async"]
    lines += [
        "",
        f"Target per rank / 1 rank <= {MEMORY_TARGET}: {_met(mem_ratio <= MEMORY_TARGET)}.",
        "",
        f"| `save_checkpoint` at {ws} ranks, same model and state ({sync['num_bytes'] / 2**20:.0f} MiB of shards; "
        f"median of {sync['n']} each, alternated, after one warm-up of each; the slowest rank) | returns after (s) | "
        "on disk after (s) |",
        "|---|---|---|",
        f"| synchronous (`checkpointing.async_save: false`) | {sync['blocking_s']:.2f} | {sync['on_disk_s']:.2f} |",
        f"| asynchronous (`checkpointing.async_save: true`; on disk: `wait_for_save` called at once) | "
        f"{asyn['blocking_s']:.2f} | {asyn['on_disk_s']:.2f} |",
        f"| asynchronous / synchronous | {asyn['blocking_s'] / sync['blocking_s']:.2f} | "
        f"{asyn['on_disk_s'] / sync['on_disk_s']:.2f} |",
        "",
        *_loading_lines(t),
        *_megatron_lines(t),
        f"The section took {t['section_s'] / 60:.1f} min, model builds and process starts included.",
        "",
    ]
    return "\n".join(lines)

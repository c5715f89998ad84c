"""The megatron backend on many ranks (torchrun, gloo on CPU) against one rank, through
tests/support/ranks/ranked_step.py, as ``python -m services.trainer`` wires a trainer of many ranks:

* Tensor parallelism 2 (dense Qwen3: fused QKV split by query group, gate/up halves, vocabulary
  rows padded and split), data parallelism 2 with the distributed optimizer (AdamW's state
  sharded over the data ranks), packed micro-batches and two updates a step, expert
  parallelism 2 (a Qwen3-MoE, each rank holding half the experts, the dense parts
  data-parallel), pipeline parallelism 2 (two layers a stage, megatron-core's schedule; in
  bfloat16, packed, with the pre-update and reference logprobs taken forward only through the
  stages), expert parallelism 2 on the tiny Qwen3.5-MoE (packed, two updates a step; its MTP
  weights published unchanged), tensor parallelism 2 with sequence parallelism on the Qwen3-MoE
  (also with routing replay: each rank's routers take the routes of its part of the sequence)
  and on the Qwen3.5-MoE (packed, two updates a step) and, on four ranks, tensor x pipeline
  parallelism 2 x 2 (dense) and tensor x pipeline x expert parallelism 2 x 2 x 2 (Qwen3.5-MoE,
  packed: the reference recipe's layout shape) each train the steps one rank trains: losses and
  gradient norms within rel 1e-5, parameters within 1e-5 after two steps at a learning rate
  (1e-4) that moves them 2e-4. The weights are published in HF layout by every
  rank and transformers loads them. At tensor parallelism with top-p 1 the logprobs come from
  each rank's vocabulary columns (megatron's vocabulary-parallel cross entropy); with top-p 0.9
  from the gathered logits.
* The tiny Qwen3.5-MoE (Gated DeltaNet and gated attention layers, routed and shared experts): its
  logprobs through the backend at pipeline parallelism 2 and expert parallelism 2 (rows packed),
  and from its megatron model split over two tensor-parallel ranks (forward only, without
  sequence parallelism), are transformers' logprobs within 1e-5; the
  step trained at pipeline and at expert parallelism 2 is the same (loss and gradient norm within
  rel 1e-5) and the torch backend's on one rank (1e-4); all in one launch
  (tests/support/ranks/megatron_hybrid_layouts.py).
* Checkpoints are independent of the layout: written at tensor x pipeline parallelism 2 x 2
  (asynchronously, top-p 0.9) or expert parallelism 2 with the distributed optimizer (each rank
  writing the AdamW state it owns), they resume on one rank, and the next step is the
  uninterrupted run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integration.test_ranks import (
    LR,
    ROOT,
    SCRIPT,
    SMALL_FILES,
    VARIANTS,
    assert_exported_in_files,
    assert_resumed_as_uninterrupted,
    assert_same_steps,
    assert_transformers_loads,
    many_ranks,
    one_rank,
    two_ranks,
    weights,
)

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

MEGATRON = ["--set", "trainer.backend=megatron", *LR]
TP2 = ["--set", "policy.megatron_cfg.tensor_model_parallel_size=2"]
PP2 = ["--set", "policy.megatron_cfg.pipeline_model_parallel_size=2"]
EP2 = ["--set", "policy.megatron_cfg.expert_model_parallel_size=2"]
SHARDED_ADAMW = ["--set", "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"]
PACKED = VARIANTS["two updates, packed micro-batches"]
TOP_P = ["--set", "policy.generation.top_p=0.9"]
REPLAY = ["--set", "policy.moe_routing_replay=true"]  # the rows carry routes (ranked_step.batch)
# what goes through the pipeline schedule: forward-only passes (the pre-update policy's logprobs,
# the reference's), bfloat16 activations between the stages, packed rows
EVERY_PASS = [
    *PACKED,
    *TOP_P,
    "--set",
    "loss_fn.reference_policy_kl_penalty=0.1",
    "--set",
    "policy.precision=bfloat16",
]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top 2) with the dense tiny model's vocabulary size."""
    out = tmp_path_factory.mktemp("tiny-moe")
    code = f"from streamrl.model_builder import build_tiny_moe; build_tiny_moe({str(out)!r}, vocab_size=1024)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    return out


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """One-rank megatron runs of two steps, made once per (model, variant) and shared."""
    made: dict[tuple[str, str], Path] = {}

    def run(model: Path, variant: str, *args: str) -> Path:
        key = (str(model), variant)
        if key not in made:
            made[key] = one_rank(model, tmp_path_factory.mktemp("one-rank") / "run", *MEGATRON, *args)
        return made[key]

    return run


LAYOUTS = {  # model, ranks, layout, what the one-rank run shares
    "tensor parallel 2": ("dense", 2, TP2, []),
    "data parallel 2, distributed optimizer, packed, two updates a step": ("dense", 2, SHARDED_ADAMW, PACKED),
    "expert parallel 2 (MoE)": ("moe", 2, EP2, []),
    "expert parallel 2 (Qwen3.5-MoE), packed, two updates a step": ("hybrid", 2, EP2, PACKED),
    "tensor parallel 2 (MoE), sequence parallel": ("moe", 2, TP2, []),
    "tensor parallel 2 (MoE), sequence parallel, routing replay": ("moe", 2, TP2, REPLAY),
    "tensor parallel 2 (Qwen3.5-MoE), sequence parallel, packed, two updates a step": ("hybrid", 2, TP2, PACKED),
    "pipeline parallel 2, bfloat16, packed, two updates, reference KL, top-p 0.9": ("dense", 2, PP2, EVERY_PASS),
    "tensor parallel 2 x pipeline parallel 2 (four ranks)": ("dense", 4, [*TP2, *PP2], []),
    # the reference recipe's layout shape, tensor x pipeline x expert
    "tensor 2 x pipeline 2 x expert parallel 2 (Qwen3.5-MoE, four ranks), packed": (
        "hybrid",
        4,
        [*TP2, *PP2, *EP2],
        PACKED,
    ),
}


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_megatron_ranks_train_the_same_steps_as_one(request, one_rank_runs, tmp_path, variant):
    kind, n, layout, extra = LAYOUTS[variant]
    model = request.getfixturevalue(
        {"dense": "tiny_model_dir", "moe": "moe_model_dir"}.get(kind, "tiny_hybrid_moe_dir")
    )
    common = ["--steps", "2", *SMALL_FILES, *extra]
    single = one_rank_runs(model, " ".join(extra), *common)
    many = many_ranks(n, model, tmp_path / f"ws{n}", *MEGATRON, *layout, *common)
    assert_exported_in_files(many, world_size=n)
    assert_same_steps(single, many)
    if kind == "moe":
        assert_transformers_loads_experts(many, tmp_path / "resaved")
    else:  # the hybrid model's MTP weights published as they were
        assert_transformers_loads(many, start=model if kind == "hybrid" else None)
    start = load_file(model / "model.safetensors")
    assert sorted(weights(many)) == sorted(start)  # HF names, padding and local experts gone
    moved = max(float((weights(single)[k].float() - start[k].float()).abs().max()) for k in start)
    assert moved > 5e-5  # the comparison above is far finer than what the steps changed


def assert_transformers_loads_experts(run: Path, resaved: Path) -> None:
    """transformers loads the exported MoE with nothing missing or left over (it fuses the experts
    in memory), and saves back exactly the exported tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(run / "weights", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded.save_pretrained(resaved)
    again, exported = load_file(resaved / "model.safetensors"), weights(run)
    assert again.keys() == exported.keys() and all(torch.equal(again[k], t) for k, t in exported.items())


@pytest.mark.parametrize(
    ("kind", "n", "layout", "extra"),
    [
        ("dense", 4, [*TP2, *PP2, "--set", "checkpointing.async_save=true"], TOP_P),
        ("moe", 2, [*EP2, *SHARDED_ADAMW], []),
    ],
    ids=[
        "tensor parallel 2 x pipeline parallel 2, top-p 0.9 (whole logits), saved asynchronously",
        "expert parallel 2 (MoE), distributed optimizer",
    ],
)
def test_a_megatron_checkpoint_resumes_at_another_layout(
    tiny_model_dir, moe_model_dir, one_rank_runs, tmp_path, kind, n, layout, extra
):
    model = tiny_model_dir if kind == "dense" else moe_model_dir
    uninterrupted = one_rank_runs(model, " ".join(extra), "--steps", "2", *SMALL_FILES, *extra)
    first = many_ranks(n, model, tmp_path / "first", *MEGATRON, *layout, *extra, "--steps", "1", "--save")
    assert len(list((first / "ckpt" / "shards").glob("*.distcp"))) == n  # a shard per rank
    second = one_rank(model, tmp_path / "second", *MEGATRON, *extra, "--load", str(first / "ckpt"), "--first-step", "1")
    assert_resumed_as_uninterrupted(second, uninterrupted)


HYBRID_LAYOUTS = ROOT / "tests" / "support" / "ranks" / "megatron_hybrid_layouts.py"


def test_qwen3_5_moe_logprobs_and_a_step_at_two_rank_layouts_are_one_ranks(tiny_hybrid_moe_dir, tmp_path):
    import torch

    from services.trainer.backends import build_backend
    from tests.support.ranks.megatron_hybrid_layouts import config, rows
    from tests.support.ranks.ranked_step import batch

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launcher, str(HYBRID_LAYOUTS), str(tiny_hybrid_moe_dir), str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    # the reference: transformers' model on one rank (the torch backend)
    try:
        reference = build_backend(config(tiny_hybrid_moe_dir, [], backend="torch"))
        given = rows()
        expected = reference.rows_logprobs(given, given[0])
        step = reference.train_step(batch(0))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for layout in ("pipeline2", "expert2", "tensor2"):
        got = torch.load(tmp_path / f"{layout}.pt")
        assert got.keys() == expected.keys(), layout
        for key, lp in expected.items():
            torch.testing.assert_close(got[key][1:], lp[1:], rtol=0, atol=1e-5, msg=f"{layout} {key}")
    # the step each layout trained is one rank's: the same as each other's (1e-5), and as the torch
    # backend's (1e-4, as the backend contract compares the two backends)
    steps = [json.loads((tmp_path / f"{layout}-step.json").read_text()) for layout in ("pipeline2", "expert2")]
    assert steps[1]["loss"] == pytest.approx(steps[0]["loss"], rel=1e-5)
    assert steps[1]["grad_norm"] == pytest.approx(steps[0]["grad_norm"], rel=1e-5)
    for trained in steps:
        assert trained["loss"] == pytest.approx(step.loss, rel=1e-4)
        assert trained["grad_norm"] == pytest.approx(step.grad_norm, rel=1e-4)


STREAM = ROOT / "tests" / "support" / "ranks" / "megatron_stream.py"


def test_the_collective_refit_stream_is_the_published_policy_on_rank_0(tiny_model_dir, tmp_path):
    """What a collective refit sends at tensor x pipeline parallelism 2 x 2 (`weight_tensors`: the
    second stage's tensors sent on to rank 0, tensor-parallel parts gathered; experts are gathered
    by the same walk as the published files, `megatron_export.stage_tensors`) is, tensor for tensor
    and in the announced order, what the same ranks publish as files; and every rank announces the
    same metadata."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    layout = [*TP2, *PP2, "--set", "policy.precision=bfloat16"]
    cmd = [*launcher, str(STREAM), str(tiny_model_dir), str(tmp_path), *layout]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "stream.json").read_text())
    streamed = report["streamed"]
    assert report["same_on_every_rank"]
    assert [[s["name"], s["shape"]] for s in streamed] == report["metadata"]
    assert sorted(s["name"] for s in streamed) == report["published"]
    assert all(s["equal"] for s in streamed), [s["name"] for s in streamed if not s["equal"]]


def test_a_nan_gradient_on_one_data_rank_fails_the_job_naming_the_parameter(tiny_model_dir, tmp_path):
    """policy.on_nonfinite_grad: fail, data parallelism 2, a NaN in one parameter's gradient on
    rank 1 only, at step 1 of 3: megatron's DDP check refuses it on rank 1 before the gradients are
    reduced, the job fails naming the parameter, and rank 0 never finishes the step."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = tmp_path / "run"
    cmd = [*launcher, str(SCRIPT), str(tiny_model_dir), str(out), *MEGATRON, "--steps", "3"]
    done = subprocess.run(
        [*cmd, "--nan-step", "1", "--nan-rank", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-4000:]
    name = (out / "poisoned-rank1.txt").read_text()
    assert "NonFiniteGradient" in said and f"non-finite gradients on rank 1 in {name}" in said, said[-4000:]
    assert not (out / "metrics.json").exists()


def test_a_nan_gradient_on_one_data_rank_is_skipped_on_every_rank_when_configured(tiny_model_dir, tmp_path):
    """policy.on_nonfinite_grad: skip, the same NaN: after the data-parallel reduction the global
    gradient norm is NaN on both ranks, both skip that update (so their replicas stay the same),
    and the job trains the other steps."""
    run = two_ranks(
        tiny_model_dir,
        tmp_path / "run",
        *MEGATRON,
        "--steps",
        "3",
        "--nan-step",
        "1",
        "--nan-rank",
        "1",
        "--set",
        "policy.on_nonfinite_grad=skip",
    )
    metrics = json.loads((run / "metrics.json").read_text())
    assert [m.get("num_skipped_updates") for m in metrics] == [None, 1, None]
    assert metrics[2]["grad_norm"] > 0

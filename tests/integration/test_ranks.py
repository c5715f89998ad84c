"""The learner on two ranks (torchrun, gloo on CPU) against one rank, through tests/support/ranks/ranked_step.py:
rank 0 drives a RankedLearner, rank 1 follows, as ``python -m services.trainer`` wires them.

* Equivalence: two steps at world size 2 give the losses and gradient norms of world size 1
  (rel 1e-5) and parameters within 1e-5. The runs are compared side by side on this machine, with a
  learning rate (1e-4) at which a wrong gradient moves parameters far more than that, while float
  summation order alone moves them about 1e-7.
* Export: the weights are published in files of at most 512 KiB (the tiny model's 4 MB make about
  eight), both ranks writing some of them; the Hugging Face index names every file and every
  tensor, transformers loads the folder, and `export_weights` returns the digests of exactly the
  files in it.
* Resharding: a checkpoint written at one world size resumes at the other (and an asynchronous
  one too) and trains the next step as the uninterrupted one-rank run does.
* Failures: a rank killed mid-step fails its partner within ``trainer.collective_timeout_s``,
  naming what was lost, whichever side died (the ranks are started by hand, so that no launcher
  tears the survivor down for them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.weights_format import folder_digests, verify_files
from streamrl.redis_server import free_port
from tests.support.published import UNTRAINED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "ranks" / "ranked_step.py"
LR = ["--set", "policy.optimizer.lr=1e-4"]
TIMEOUT_S = 20
MAX_FILE_BYTES = 512 * 1024
SMALL_FILES = ["--max-weight-file-bytes", str(MAX_FILE_BYTES)]


# A rank has once, in a loaded CI session (megatron, tensor parallel 2), aborted natively with this
# line and nothing else: no Python traceback, and it did not come back in six runs of the same
# layout beside two busy loops. Such a launch runs once more (its log kept); anything else fails.
NATIVE_ABORT = "terminate called without an active exception"


def _run(cmd: list[str], out: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    log = out.parent / f"{out.name}.log"
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and NATIVE_ABORT in done.stderr:
        log.with_suffix(".aborted.log").write_text(done.stdout + done.stderr)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def one_rank(model: Path, out: Path, *args: str) -> Path:
    _run([sys.executable, str(SCRIPT), str(model), str(out), *args], out)
    return out


def two_ranks(model: Path, out: Path, *args: str) -> Path:
    return many_ranks(2, model, out, *args)


def many_ranks(n: int, model: Path, out: Path, *args: str) -> Path:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    _run([*launcher, str(SCRIPT), str(model), str(out), *args], out)
    return out


def weights(run: Path) -> dict:
    folder = run / "weights"
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(folder / "model.safetensors")
    loaded = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        loaded.update(load_file(folder / name))
    return loaded


def assert_exported_in_files(run: Path, world_size: int) -> None:
    """The weights are in several files named by the index, each written by one rank, and the
    manifest `export_weights` returned is the digests of exactly those files."""
    folder = run / "weights"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest == folder_digests(folder)
    verify_files(folder, manifest)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    n = len(manifest)
    assert n > 2 and set(index["weight_map"].values()) == set(manifest)
    assert sorted(manifest) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    tensors = weights(run)
    assert index["weight_map"].keys() == tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())  # a file holds one at least
    assert all((folder / f).stat().st_size <= max(MAX_FILE_BYTES, largest) + 4096 for f in manifest)  # + header
    by_rank = [json.loads((run / f"manifest-rank{r}.json").read_text()) for r in range(world_size)]
    assert by_rank[0] == manifest  # rank 0 returns every rank's files
    if world_size == 2:
        assert by_rank[1] and by_rank[1].items() < manifest.items()  # rank 1 wrote some, rank 0 the rest


def assert_transformers_loads(run: Path, start: Path | None = None) -> None:
    """transformers loads the published weights, every tensor as published (under the names the
    checkpoint stores them by: fused experts one by one). With ``start``, the tensors the model
    does not hold (MTP weights) are the starting checkpoint's, unchanged."""
    from transformers import AutoModelForCausalLM

    from shared_torch.stored_names import as_stored

    exported = weights(run)
    dtype = next(iter(exported.values())).dtype  # the precision the run published in
    model = AutoModelForCausalLM.from_pretrained(run / "weights", torch_dtype=dtype)
    loaded = dict(as_stored(model, model.state_dict().items()))
    assert loaded.keys() <= exported.keys() and all(torch.equal(exported[k], t) for k, t in loaded.items())
    untrained = exported.keys() - loaded.keys()
    if start is None:
        assert not untrained
        return
    original = load_file(start / "model.safetensors")
    assert untrained == {k for k in original if k.startswith("mtp.")}
    assert all(torch.equal(exported[k], original[k]) for k in untrained)


def metrics(run: Path) -> list[dict]:
    return json.loads((run / "metrics.json").read_text())


def max_param_diff(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def assert_same_steps(a: Path, b: Path) -> None:
    for x, y in zip(metrics(a), metrics(b), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-8)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
        assert (y["train_tokens"], y["num_updates"]) == (x["train_tokens"], x["num_updates"])
    assert max_param_diff(a, b) < 1e-5


def assert_resumed_as_uninterrupted(resumed_run: Path, uninterrupted: Path) -> None:
    """The resumed run's one step is step 1 of the uninterrupted run: same loss and norm, same
    learning rate, same parameters."""
    [resumed] = metrics(resumed_run)
    expected = metrics(uninterrupted)[1]
    assert resumed["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-8)
    assert resumed["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert resumed["lr"] == expected["lr"]
    assert max_param_diff(resumed_run, uninterrupted) < 1e-5


VARIANTS = {  # one update per step is the activation-checkpointing variant's (and the resume tests')
    "two updates, packed micro-batches": [
        "--set",
        "policy.train_global_batch_size=6",
        "--set",
        "policy.sequence_packing.enabled=true",
        "--set",
        "policy.sequence_packing.train_mb_tokens=64",
    ],
    "activation checkpointing": ["--set", "policy.dtensor_cfg.activation_checkpointing=true"],
}


CASES = [
    *(pytest.param("tiny_model_dir", v, id=v) for v in VARIANTS),
    # The hybrid model's linear-attention layers, routed experts and shared expert, sharded.
    pytest.param("tiny_hybrid_moe_dir", "two updates, packed micro-batches", id="Qwen3.5-MoE, packed"),
]


@pytest.mark.parametrize(("model", "variant"), CASES)
def test_two_ranks_train_the_same_steps_as_one(model, variant, tmp_path, request):
    model_dir = request.getfixturevalue(model)
    args = [*LR, "--steps", "2", *SMALL_FILES, *VARIANTS[variant]]
    single = one_rank(model_dir, tmp_path / "ws1", *args)
    double = two_ranks(model_dir, tmp_path / "ws2", *args)
    assert_exported_in_files(single, world_size=1)
    assert_exported_in_files(double, world_size=2)
    assert_same_steps(single, double)  # the tensors of both exports, through their indexes
    assert_transformers_loads(double, model_dir)
    start = load_file(model_dir / "model.safetensors")
    trained = weights(single)
    moved = max(float((trained[k] - start[k].float()).abs().max()) for k in trained.keys() & start.keys())
    assert moved > 5e-5  # the comparison above is far finer than what the steps changed


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    return one_rank(tiny_model_dir, tmp_path_factory.mktemp("uninterrupted") / "run", *LR, "--steps", "2")


@pytest.mark.parametrize(
    ("saved_at", "resumed_at", "extra"),
    # Saved synchronously at one rank, asynchronously at two (a synchronous save at two ranks is
    # the sharded checkpoint of tests/faults/test_trainer_rank_kill.py).
    [(1, 2, []), (2, 1, ["--set", "checkpointing.async_save=true"])],
    ids=["1 to 2", "2 to 1, saved asynchronously"],
)
def test_a_checkpoint_resumes_at_another_world_size(
    tiny_model_dir, tmp_path, uninterrupted, saved_at, resumed_at, extra
):
    launch = {1: one_rank, 2: two_ranks}
    first = launch[saved_at](tiny_model_dir, tmp_path / "first", *LR, "--steps", "1", "--save", *extra)
    assert sorted(p.name for p in (first / "ckpt").iterdir()) == ["shards", "trainer_state.pt"]
    assert len(list((first / "ckpt" / "shards").glob("*.distcp"))) == saved_at  # a shard per rank
    second = launch[resumed_at](
        tiny_model_dir, tmp_path / "second", *LR, "--load", str(first / "ckpt"), "--first-step", "1"
    )
    assert_resumed_as_uninterrupted(second, uninterrupted)


def _by_hand(model: Path, out: Path, killed: int) -> list[subprocess.Popen[str]]:
    """Two ranks started without a launcher; rank ``killed`` kills itself in step 1's first pass."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        cmd = [
            sys.executable,
            str(SCRIPT),
            str(model),
            str(out),
            "--steps",
            "3",
            "--kill-rank",
            str(killed),
            "--kill-step",
            "1",
            "--set",
            f"trainer.collective_timeout_s={TIMEOUT_S}",
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return procs


@pytest.mark.parametrize("killed", [1, 0], ids=["a follower dies", "rank 0 dies"])
def test_a_killed_rank_fails_its_partner_within_the_collective_timeout(tiny_model_dir, tmp_path, killed):
    procs = _by_hand(tiny_model_dir, tmp_path / "run", killed)
    try:
        assert procs[killed].wait(120) == -signal.SIGKILL
        t_dead = time.monotonic()
        survivor = procs[1 - killed]
        code = survivor.wait(TIMEOUT_S + 30)
        waited = time.monotonic() - t_dead
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    output = survivor.stdout.read() if survivor.stdout else ""
    assert code != 0, output[-3000:]
    assert waited < TIMEOUT_S + 30  # the requirement: trainer.collective_timeout_s, with room for a loaded machine
    if killed == 1:
        assert "trainer ranks lost during train" in output, output[-3000:]


@pytest.mark.parametrize(
    "model", ["tiny_model_dir", "tiny_multimodal_moe_dir"], ids=["Qwen3", "Qwen3.5-MoE multimodal"]
)
def test_each_rank_reads_only_its_shards_of_the_checkpoint(model, tmp_path, request):
    """At two ranks the policy is built on the meta device, sharded, then filled from the
    safetensors file, each rank reading its own rows: about half the bytes each, the whole model
    between them, and the model is the checkpoint exactly (exported without a step). A multimodal
    checkpoint's language model is read from under its own names (``model.language_model.*``) and
    published under them, its vision tower and MTP weights carried, not read."""
    model_dir = request.getfixturevalue(model)
    double = two_ranks(model_dir, tmp_path / "ws2", "--steps", "0", *SMALL_FILES)
    start = load_file(model_dir / "model.safetensors")
    exported = weights(double)
    assert sorted(exported) == sorted(start)
    assert all(torch.equal(exported[k], start[k].float()) for k in start)
    assert json.loads((double / "weights" / "config.json").read_text()) == json.loads(
        (model_dir / "config.json").read_text()
    )
    read = [json.loads((double / f"load-rank{r}.json").read_text())["bytes_read"] for r in (0, 1)]
    total = sum(t.numel() * t.element_size() for k, t in start.items() if not k.startswith(UNTRAINED))
    assert sum(read) == total and max(read) < 0.6 * total
    single = one_rank(model_dir, tmp_path / "ws1", "--steps", "0")
    assert json.loads((single / "load-rank0.json").read_text())["bytes_read"] is None  # one rank: loaded whole

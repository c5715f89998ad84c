"""A refit without a gather into real vLLM engines of one and of two ranks.

A trainer of two ranks (torchrun over gloo: FSDP2, each rank holding half of every parameter's
rows; or megatron at tensor parallel 2, each rank half of every projection) refits vLLM
generator processes that started on random weights (``load_format: dummy``) along the resharding
plan (``refit.collective.method: reshard``): each trainer rank sends each engine rank the slices
of its own shard that the engine rank keeps. Layouts: one generator of ``tensor_parallel_size:
2`` (each engine rank keeps half of every projection, its heads of the fused QKV, its half of
the vocabulary) from either backend. (Generators of one rank: the demo across hosts,
tests/multihost, from two trainer nodes; two of them, one killed mid-transfer:
tests/faults/test_refit_generator_kill.py.) Every refit is probed
(`services.trainer.refit_probe`). Afterwards each generator must answer exactly as a vLLM engine
started cold on the trainer's exported weights: the same sampled tokens under a fixed seed,
logprobs within float32 noise. Nothing here can pass on random weights: the engines started on
them, so only the transfer brings the trainer's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest

from shared.config import load
from shared.run_config import RunConfig
from tests.support.generator import in_process_generator
from tests.support.runs import FaultRun, write_run_config

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 6]
TOKENS = 8

# (engine ranks, generators, training backend): FSDP2's row shards, and megatron's tensor-parallel
# parts (each rank half of every projection's columns or rows, its heads of the fused QKV)
LAYOUTS = {
    "one TP2 generator": (2, 1, "torch"),
    "megatron TP2 into one TP2 generator": (2, 1, "megatron"),
}


def _settings(run_id: str, tp: int, backend: str) -> dict:
    megatron = {"policy.megatron_cfg.tensor_model_parallel_size": 2} if backend == "megatron" else {}
    return {
        **megatron,
        "trainer.backend": backend,
        "run.run_id": run_id,
        "policy.generation.backend": "vllm",
        "policy.generation.vllm_cfg.tensor_parallel_size": tp,
        "policy.generation.vllm_cfg.dtype": "float32",
        "policy.generation.vllm_cfg.enforce_eager": True,
        "policy.generation.vllm_cfg.max_model_len": 512,
        "policy.precision": "float32",
        "refit.transport": "collective",
        "refit.collective.method": "reshard",
        "refit.collective.master_address": "127.0.0.1",
        "refit.collective.bucket_mb": 1,
        "trainer.torch_threads": 1,
        "trainer.refit_timeout_s": 240.0,
    }


def _answers(base_url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": TOKENS, "seed": 7, "logprobs": 1}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["generation_token_ids"], choice["generation_log_probs"]))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_engines_receive_their_shards_from_every_trainer_rank(layout, tmp_path, tiny_model_dir, redis_url):
    tp, count, backend = LAYOUTS[layout]
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    run_id = f"reshard-{uuid.uuid4().hex[:6]}"
    config = write_run_config(tmp_path, tiny_model_dir, redis_url, run_id, _settings(run_id, tp, backend))
    run = FaultRun(tmp_path, config)
    exported = tmp_path / "exported"
    try:
        gens = [run.start("services.generator", f"generator-{i}") for i in range(count)]
        with open(tmp_path / "trainer.log", "wb") as log:
            trainer = _publish(config, count, tmp_path, exported, log)
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-8000:] + run.logs()
        refits = json.loads((tmp_path / "refits.json").read_text())["refits"]
        assert [r["generators"] for r in refits] == [[g.worker_id for g in gens]] * 2
        assert all(r["transport"] == "collective" and r["attempts"] == 1 for r in refits)
        assert all(r["probe_error"] is not None and r["probe_error"] < 1e-3 for r in refits)
        served = [_answers(g.url) for g in gens]
    finally:
        run.stop_all()
    cold_cfg = load(RunConfig, config, env={})
    cold_cfg = _cold(cold_cfg, str(exported))
    async with in_process_generator(cold_cfg) as cold:
        expected = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": TOKENS, "seed": 7, "logprobs": 1}
            r = await cold.client.post("/v1/completions", json=body)
            choice = r.json()["choices"][0]
            expected.append((choice["generation_token_ids"], choice["generation_log_probs"]))
    for answers in served:
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, expected, strict=True):
            assert tokens == want_tokens
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-3


def _cold(cfg: RunConfig, folder: str) -> RunConfig:
    """``cfg``'s engine as one rank on ``folder``'s weights, read at start, in a run of its own."""
    import msgspec

    v = msgspec.structs.replace(cfg.policy.generation.vllm_cfg, tensor_parallel_size=1, load_format="auto")
    generation = msgspec.structs.replace(cfg.policy.generation, vllm_cfg=v)
    tokenizer = cfg.policy.tokenizer_path  # the export holds the weights only
    policy = msgspec.structs.replace(cfg.policy, model_name=folder, tokenizer_name=tokenizer, generation=generation)
    run = msgspec.structs.replace(cfg.run, run_id=f"{cfg.run.run_id}-cold")
    refit = msgspec.structs.replace(cfg.refit, transport="filesystem")
    return msgspec.structs.replace(cfg, policy=policy, run=run, refit=refit)


def _publish(config, count: int, tmp_path, exported, log) -> subprocess.CompletedProcess[bytes]:
    """Two trainer ranks (torchrun) refit the run's ``count`` generators twice, then export."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--standalone",
            "-m",
            "streamrl.bench.reshard_worker",
            "--config",
            str(config),
            "--generators",
            str(count),
            "--refits",
            "2",
            "--settle-s",
            "0",
            "--out",
            str(tmp_path / "refits.json"),
            "--export",
            str(exported),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        timeout=600,
    )

"""Parallel layouts the reference recipe asks for either reach the engine (vLLM expert parallel,
Megatron tensor and expert parallel) or are refused by name (Megatron pipeline stages, sizes that
do not divide the trainer's ranks), never ignored."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer.backends.megatron_backend import check_supported
from shared.config import load
from shared.config_error import ConfigError
from shared.run_config import RunConfig

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml"
BASE = ["policy.model_name=m", "data.train_path=t.jsonl", "trainer.backend=megatron"]


@pytest.mark.parametrize("key", ["tensor_model_parallel_size", "expert_model_parallel_size"])
def test_megatron_parallel_sizes_must_divide_the_ranks(key):
    check_supported(load(RunConfig, None, BASE, env={}).policy)  # the defaults are supported
    cfg = load(RunConfig, None, BASE + [f"policy.megatron_cfg.{key}=2"], env={})
    check_supported(cfg.policy, world_size=4)
    with pytest.raises(ConfigError, match=f"policy.megatron_cfg.{key} is 2; it must divide the trainer's 3 ranks"):
        check_supported(cfg.policy, world_size=3)


def test_megatron_backend_refuses_pipeline_stages_and_so_the_recipe():
    cfg = load(RunConfig, None, BASE + ["policy.megatron_cfg.pipeline_model_parallel_size=2"], env={})
    with pytest.raises(ConfigError, match="policy.megatron_cfg.pipeline_model_parallel_size is 2"):
        check_supported(cfg.policy, world_size=2)
    check_supported(load(RunConfig, None, BASE + ["policy.sequence_packing.enabled=true"], env={}).policy)
    recipe = load(RunConfig, RECIPE, env={})
    assert (
        recipe.policy.megatron_cfg.tensor_model_parallel_size,
        recipe.policy.megatron_cfg.pipeline_model_parallel_size,
        recipe.policy.megatron_cfg.expert_model_parallel_size,
    ) == (4, 2, 32)
    with pytest.raises(ConfigError, match="policy.megatron_cfg.pipeline_model_parallel_size is 2"):
        check_supported(recipe.policy, world_size=64)


def test_vllm_engine_args_carry_expert_parallel():
    pytest.importorskip("vllm")
    from services.generator.vllm_engine import VllmEngine

    args = VllmEngine(load(RunConfig, RECIPE, env={}))._engine_args()
    assert args.enable_expert_parallel is True and args.tensor_parallel_size == 8
    plain = VllmEngine(load(RunConfig, None, BASE, env={}))._engine_args()
    assert plain.enable_expert_parallel is False


def test_trainer_refuses_a_layout_it_cannot_run_before_joining_the_other_ranks():
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "0", "STREAMRL_API_TOKEN": "t0ken"}
    out = subprocess.run(
        [sys.executable, "-m", "services.trainer", "--config", str(RECIPE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2
    assert "policy.megatron_cfg.pipeline_model_parallel_size is 2" in out.stderr

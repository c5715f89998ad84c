"""Parallel layouts the reference recipe asks for either reach the engine (vLLM expert parallel,
Megatron tensor, pipeline and expert parallel) or are refused by name (sizes that do not divide
the trainer's ranks or the model's layers, pipeline stages over tied embeddings, architectures the
backend does not build), never ignored."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer.backends.megatron_setup import check_supported
from shared.config import load
from shared.config_error import ConfigError
from shared.run_config import RunConfig

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml"
BASE = ["policy.model_name=m", "data.train_path=t.jsonl", "trainer.backend=megatron"]


@pytest.mark.parametrize(
    "key", ["tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"]
)
def test_megatron_parallel_sizes_must_divide_the_ranks(key):
    check_supported(load(RunConfig, None, BASE, env={}).policy)  # the defaults are supported
    cfg = load(RunConfig, None, BASE + [f"policy.megatron_cfg.{key}=2"], env={})
    check_supported(cfg.policy, world_size=4)
    with pytest.raises(ConfigError, match=f"policy.megatron_cfg.{key} is 2; it must divide the trainer's 3 ranks"):
        check_supported(cfg.policy, world_size=3)


def test_tensor_and_expert_ranks_times_the_stages_must_divide_the_ranks():
    sizes = ["policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.megatron_cfg.tensor_model_parallel_size=2"]
    cfg = load(RunConfig, None, BASE + sizes, env={})
    check_supported(cfg.policy, world_size=4)
    with pytest.raises(ConfigError, match=r"tensor x pipeline parallel sizes \(4 ranks\) must divide the trainer's 2"):
        check_supported(cfg.policy, world_size=2)


def test_context_parallelism_is_refused_by_name():
    cfg = load(RunConfig, None, BASE + ["policy.megatron_cfg.context_parallel_size=2"], env={})
    with pytest.raises(ConfigError, match="policy.megatron_cfg.context_parallel_size is 2; .* supports only 1"):
        check_supported(cfg.policy, world_size=2)


def _model_dir(tmp_path: Path, **config) -> str:
    hf = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "tie_word_embeddings": False,
        **config,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"num_hidden_layers": 6}, "pipeline_model_parallel_size is 4; it must divide the model's 6 layers"),
        ({"tie_word_embeddings": True}, "pipeline stages need untied embeddings"),
        ({"model_type": "qwen3_5_moe"}, "not model_type 'qwen3_5_moe'"),
    ],
)
def test_a_checkpoint_the_stages_cannot_split_is_refused_before_joining(tmp_path, config, refusal):
    stages = ["policy.megatron_cfg.pipeline_model_parallel_size=4"]
    fits = load(RunConfig, None, BASE + stages + [f"policy.model_name={_model_dir(tmp_path)}"], env={})
    check_supported(fits.policy, world_size=4)
    cfg = load(RunConfig, None, BASE + stages + [f"policy.model_name={_model_dir(tmp_path, **config)}"], env={})
    with pytest.raises(ConfigError, match=refusal):
        check_supported(cfg.policy, world_size=4)


def test_the_recipes_layout_fits_its_64_ranks():
    recipe = load(RunConfig, RECIPE, env={})
    assert (
        recipe.policy.megatron_cfg.tensor_model_parallel_size,
        recipe.policy.megatron_cfg.pipeline_model_parallel_size,
        recipe.policy.megatron_cfg.expert_model_parallel_size,
    ) == (4, 2, 32)
    check_supported(recipe.policy, world_size=64)
    with pytest.raises(
        ConfigError, match=r"expert x pipeline parallel sizes \(64 ranks\) must divide the trainer's 32"
    ):
        check_supported(recipe.policy, world_size=32)


def test_vllm_engine_args_carry_expert_parallel():
    pytest.importorskip("vllm")
    from services.generator.vllm_engine import VllmEngine

    args = VllmEngine(load(RunConfig, RECIPE, env={}))._configured_engine_args()  # no model at hand
    assert args.enable_expert_parallel is True and args.tensor_parallel_size == 8
    plain = VllmEngine(load(RunConfig, None, BASE, env={}))._configured_engine_args()
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
    assert "policy.megatron_cfg.expert_model_parallel_size is 32; it must divide the trainer's 4 ranks" in out.stderr

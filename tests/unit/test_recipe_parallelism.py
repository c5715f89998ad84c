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


# the language model of a multimodal Qwen3.5-MoE checkpoint (its text_config), in four layers
_QWEN3_5_MOE_TEXT = {
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "tie_word_embeddings": False,
}


def _multimodal(model_type: str = "qwen3_5_moe", text_model_type: str = "qwen3_5_moe_text", **text) -> dict:
    """A multimodal checkpoint's config: its language model's under text_config."""
    text_config = {**_QWEN3_5_MOE_TEXT, "model_type": text_model_type, **text}
    return {"model_type": model_type, "text_config": text_config, "vision_config": {"depth": 1}}


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"num_hidden_layers": 6}, "pipeline_model_parallel_size is 4; it must divide the model's 6 layers"),
        ({"tie_word_embeddings": True}, "pipeline stages need untied embeddings"),
        # a multimodal checkpoint is judged by its language model (the top level's 4 layers are not its)
        (_multimodal(num_hidden_layers=6), "pipeline_model_parallel_size is 4; it must divide the model's 6 layers"),
        # multimodal checkpoints whose language model the backend does not build: dense Qwen3.5's, and
        # a Qwen3.5-MoE whose text_config is another model's
        (
            _multimodal("qwen3_5", "qwen3_5_text"),
            "multimodal checkpoints of model_type 'qwen3_5_moe' only, not model_type 'qwen3_5'",
        ),
        (_multimodal("qwen3_5_moe", "qwen3_5_text"), "language models, not model_type 'qwen3_5_text'"),
    ],
    ids=["layers", "tied", "multimodal layers", "dense multimodal", "multimodal of another text model"],
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


# the language model of the released Qwen3.5-397B-A17B, as its model card gives it: 60 layers (three Gated
# DeltaNet, then one gated attention), 32 query heads over 2 key-value heads, 512 experts
_QWEN3_5_397B_TEXT = {
    "num_hidden_layers": 60,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "vocab_size": 248320,
}


def test_the_recipes_checkpoint_is_refused_at_its_tensor_parallel_size_alone(tmp_path):
    """The recipe on a multimodal checkpoint of the released 397B's shape: the megatron backend
    builds its language model and the recipe's pipeline and expert sizes fit it, but its tensor
    parallelism 4 is refused before the ranks join (4 does not divide the 2 key-value heads); at 2
    it trains with sequence parallelism, and refuses to without it."""
    (tmp_path / "config.json").write_text(json.dumps(_multimodal(**_QWEN3_5_397B_TEXT)))

    def policy(tp: int, *more: str):
        sizes = [f"policy.model_name={tmp_path}", f"policy.megatron_cfg.tensor_model_parallel_size={tp}", *more]
        return load(RunConfig, RECIPE, sizes, env={}).policy

    with pytest.raises(ConfigError, match="tensor_model_parallel_size is 4; it must divide the checkpoint's 2 num_key"):
        check_supported(policy(4), world_size=64)
    check_supported(policy(2), world_size=64)
    check_supported(policy(1), world_size=64)
    with pytest.raises(ConfigError, match="sequence_parallel is false; model_type 'qwen3_5_moe_text' trains at"):
        check_supported(policy(2, "policy.megatron_cfg.sequence_parallel=false"), world_size=64)


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


def _one_host_overrides(out: Path) -> list[str]:
    """The overrides scripts/recipe_on_one_host.sh passes, with its output folder ``out``."""
    text = RECIPE.with_name("qwen3_5_397b_a17b_on_one_host.overrides").read_text()
    return [line.replace("${OUT}", str(out)) for line in text.splitlines() if line and not line.startswith("#")]


def test_the_recipe_on_one_host_keeps_its_layout_shape_and_generator(tmp_path):
    """The recipe with its one-host overrides loads, fits four ranks on the tiny Qwen3.5-MoE's
    config, and keeps what it does not scale: tensor x pipeline x expert parallelism each above 1
    (sequence parallel), bfloat16, sequence packing, the trajectory age,
    the loss, and vLLM's settings (expert parallel, bfloat16, prefix caching, dummy weights)."""
    (tmp_path / "policy-init").mkdir()
    (tmp_path / "policy-init" / "config.json").write_text(json.dumps(_QWEN3_5_MOE_TEXT))
    recipe = load(RunConfig, RECIPE, env={})
    cfg = load(RunConfig, RECIPE, _one_host_overrides(tmp_path), env={})
    m = cfg.policy.megatron_cfg
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size) == (2, 2, 2)
    assert cfg.trainer.nproc_per_node == 4 and cfg.trainer.backend == "megatron"
    check_supported(cfg.policy, world_size=4)
    assert cfg.policy.precision == recipe.policy.precision
    assert cfg.policy.sequence_packing.enabled and recipe.policy.sequence_packing.enabled
    assert cfg.loss_fn == recipe.loss_fn and cfg.grpo.async_grpo == recipe.grpo.async_grpo
    v, rv = cfg.policy.generation.vllm_cfg, recipe.policy.generation.vllm_cfg
    for kept in ("dtype", "enable_expert_parallel", "enable_prefix_caching", "load_format"):
        assert getattr(v, kept) == getattr(rv, kept), kept
    gen, rgen = cfg.policy.generation, recipe.policy.generation
    assert (gen.temperature, gen.top_p, gen.val_temperature, gen.val_top_p) == (
        rgen.temperature,
        rgen.top_p,
        rgen.val_temperature,
        rgen.val_top_p,
    )

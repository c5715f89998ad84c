"""Model FLOPs per token (`services.trainer.flops`) against hand counts, and the MFU a step gets
from them: the devices' peak from config, from the GPU's name, or none on a CPU."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.trainer.flops import MfuMeter, ModelFlops, flops_per_token, model_flops, peak_tflops
from shared.config_error import ConfigError
from shared.run_config import RunConfig

pytestmark = pytest.mark.unit

# The demo's tiny dense Qwen3 (streamrl.model_builder.TinyModelSpec).
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "tie_word_embeddings": False,
}
# The megatron tests' tiny Qwen3-MoE (streamrl.model_builder.build_tiny_moe): 4 experts, top 2.
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}
# The demo's tiny Qwen3.5-MoE: three Gated DeltaNet layers, then one of gated softmax attention.
QWEN3_5_MOE = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


def test_dense_qwen3_by_hand():
    attention = 128 * 128 + 128 * 64 + 128 * 64 + 128 * 128  # q, k, v (2 kv heads of 32), o
    mlp = 3 * 128 * 384  # gate, up, down
    n = 4 * (attention + mlp) + 128 * 1024  # + the LM head; the embedding is a lookup
    assert n == 917_504
    assert model_flops(QWEN3) == ModelFlops(active_params=n, attention_layers=4, attention_width=128)
    # 6N + 12 x layers x (heads x head_dim) x S
    assert flops_per_token(QWEN3, 1000) == 6 * n + 12 * 4 * 128 * 1000


def test_moe_counts_only_the_experts_a_token_is_routed_to():
    attention = 64 * 128 + 64 * 64 + 64 * 64 + 128 * 64
    experts = 2 * 3 * 64 * 64  # top 2 of 4 experts, gate/up/down each
    router = 64 * 4
    n = 2 * (attention + experts + router) + 64 * 512
    assert model_flops(QWEN3_MOE).active_params == n == 131_584
    wider = model_flops({**QWEN3_MOE, "num_experts": 64})
    assert wider.active_params - n == 2 * 64 * 60  # sixteen times the experts: only the router grows
    top4 = model_flops({**QWEN3_MOE, "num_experts_per_tok": 4})
    assert top4.active_params - n == 2 * 2 * 3 * 64 * 64
    dense_first = model_flops({**QWEN3_MOE, "mlp_only_layers": [0]})  # a dense MLP in layer 0
    assert dense_first.active_params - n == 3 * 64 * 128 - (experts + router)


def test_hybrid_linear_attention_layers_have_no_quadratic_term():
    h, key, value = 128, 2 * 64, 4 * 64
    linear = h * (2 * key + value) + h * value + 2 * h * 4 + value * h + (2 * key + value) * 4  # qkv, z, a+b, out, conv
    gated = h * 4 * 32 * 2 + 2 * h * 2 * 32 + 4 * 32 * h  # q twice as wide (its output gate), k, v, o
    moe = 2 * 3 * h * 128 + 3 * h * 128 + h * 8 + h  # top 2, shared expert, router, shared expert gate
    flops = model_flops(QWEN3_5_MOE)
    assert flops.active_params == 3 * linear + gated + 4 * moe + h * 1024
    assert flops.attention_layers == 1
    assert flops.per_token(2048) - flops.per_token(1024) == 12 * 1 * 128 * 1024


def test_shapes_agree_with_the_transformers_models():
    """N is the matrix parameters of the model transformers builds, its experts' weights
    counted at top-k / experts (norms, embedding and the recurrence's gates left out)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def matrix_params(model: object, experts: int, top_k: int) -> int:
        total = 0
        for name, p in model.named_parameters():  # type: ignore[attr-defined]
            if any(s in name for s in ("norm", "embed_tokens", "A_log", "dt_bias")):
                continue
            total += p.numel() * top_k // experts if ".experts." in name else p.numel()
        return total

    torch.manual_seed(0)
    for cls, cfg_cls, tree, experts, top_k in (
        ("Qwen3ForCausalLM", "Qwen3Config", QWEN3, 1, 1),
        ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE, 4, 2),
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", QWEN3_5_MOE, 8, 2),
    ):
        config = getattr(transformers, cfg_cls)(**{k: v for k, v in tree.items() if k != "model_type"})
        model = getattr(transformers, cls)(config)
        assert model_flops(config).active_params == matrix_params(model, experts, top_k), cls


def test_a_multimodal_config_is_read_through_its_text_config():
    outer = {"model_type": "qwen3_5_moe", "text_config": {k: v for k, v in QWEN3_5_MOE.items() if k != "model_type"}}
    assert model_flops(outer) == model_flops(QWEN3_5_MOE)


def test_a_config_without_a_shape_names_the_key():
    with pytest.raises(ValueError, match="'hidden_size'"):
        model_flops({"model_type": "bert"})


def test_peak_by_device_name_and_precision():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops("NVIDIA H200", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert peak_tflops("cpu", "bfloat16") is None


def _cfg(tmp_path, *overrides: str) -> RunConfig:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    tree: dict = {"policy": {"model_name": str(tmp_path), "precision": "bfloat16"}, "trainer": {}}
    for item in overrides:
        key, value = item.split("=")
        tree["trainer"][key] = float(value)
    return msgspec.convert(tree, RunConfig)


def test_mfu_of_a_step(tmp_path):
    meter = MfuMeter.from_config(_cfg(tmp_path), devices=2, device_name="NVIDIA H100 80GB HBM3")
    assert meter.peak_tflops == 989.0
    seq_lens = [300, 500]
    flops = sum(s * (6 * 917_504 + 12 * 4 * 128 * s) for s in seq_lens)
    tflops, mfu = meter.measure(seq_lens, train_s=0.5)
    assert tflops == pytest.approx(flops / 0.5 / 2 / 1e12)
    assert mfu == pytest.approx(tflops / 989.0)
    assert meter.measure([], train_s=0.5) == (None, None)  # nothing trained


def test_a_cpu_has_no_mfu_unless_its_peak_is_configured(tmp_path):
    cpu = MfuMeter.from_config(_cfg(tmp_path), devices=1, device_name="cpu")
    tflops, mfu = cpu.measure([100], train_s=1.0)
    assert tflops is not None and tflops > 0 and mfu is None
    configured = MfuMeter.from_config(_cfg(tmp_path, "peak_tflops_per_device=2"), devices=1, device_name="cpu")
    assert configured.measure([100], train_s=1.0)[1] == pytest.approx(tflops / 2.0)
    with pytest.raises((msgspec.ValidationError, ConfigError), match="peak_tflops_per_device"):
        _cfg(tmp_path, "peak_tflops_per_device=0")


def test_an_unreadable_model_leaves_the_figures_null(tmp_path):
    cfg = msgspec.convert({"policy": {"model_name": str(tmp_path / "missing")}}, RunConfig)
    meter = MfuMeter.from_config(cfg, devices=1, device_name="NVIDIA H100 80GB HBM3")
    assert meter.flops is None and meter.measure([100], train_s=1.0) == (None, None)


def test_a_hybrid_config_may_give_only_the_full_attention_interval():
    by_interval = {k: v for k, v in QWEN3_5_MOE.items() if k != "layer_types"} | {"full_attention_interval": 4}
    assert model_flops(by_interval) == model_flops(QWEN3_5_MOE)

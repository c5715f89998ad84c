"""The megatron backend's CPU-testable parts: the DDP config plumbing (check_for_nan_in_grad on
unless disabled, unknown fields named), the TransformerConfig derived from the tiny Qwen3 config,
and the HF <-> Megatron weight layouts, checked against a GPTModel built on CPU."""

import json
import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from services.trainer.backends.megatron_convert import (  # noqa: E402
    hf_to_megatron,
    megatron_to_hf,
    read_hf_state,
    transformer_config_kwargs,
)
from services.trainer.backends.megatron_setup import build_gpt_model, ddp_config  # noqa: E402
from shared.config import load  # noqa: E402
from shared.config_error import ConfigError  # noqa: E402
from shared.run_config import RunConfig  # noqa: E402

pytestmark = pytest.mark.unit


def _policy(*overrides: str):
    base = ["policy.model_name=m", "data.train_path=t.jsonl", "trainer.backend=megatron"]
    return load(RunConfig, None, base + list(overrides), env={}).policy


def test_nan_check_follows_on_nonfinite_grad_unless_set_and_fields_pass_through():
    assert ddp_config(_policy()).check_for_nan_in_grad is True  # policy.on_nonfinite_grad: fail
    assert ddp_config(_policy("policy.on_nonfinite_grad=skip")).check_for_nan_in_grad is False
    key = "policy.megatron_cfg.distributed_data_parallel_config"
    off = ddp_config(
        _policy(f"{key}.check_for_nan_in_grad=false", f"{key}.grad_reduce_in_fp32=true", f"{key}.bucket_size=1000000")
    )
    assert off.check_for_nan_in_grad is False and off.grad_reduce_in_fp32 is True and off.bucket_size == 1_000_000


def test_unknown_ddp_field_is_named():
    with pytest.raises(ConfigError, match="distributed_data_parallel_config.overlap_everything"):
        ddp_config(_policy("policy.megatron_cfg.distributed_data_parallel_config.overlap_everything=true"))


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return json.loads((tiny_model_dir / "config.json").read_text())


def test_transformer_config_follows_the_hf_config(hf):
    kw = transformer_config_kwargs(hf)
    assert (kw["num_layers"], kw["hidden_size"], kw["ffn_hidden_size"]) == (4, 128, 384)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (4, 2, 32)
    assert kw["qk_layernorm"] and kw["gated_linear_unit"] and not kw["add_bias_linear"]
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        transformer_config_kwargs({**hf, "model_type": "llama"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cpu_gpt(hf):
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield build_gpt_model(hf, torch.float32, cpu_init=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_hf_weights_load_into_the_megatron_model_and_round_trip(tiny_model_dir, hf, cpu_gpt):
    state = read_hf_state(tiny_model_dir)
    converted = hf_to_megatron(state, hf)
    missing, unexpected = cpu_gpt.load_state_dict(converted, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    back = megatron_to_hf({k: v for k, v in cpu_gpt.state_dict().items() if not k.endswith("_extra_state")}, hf)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_qkv_is_fused_by_query_group(hf):
    # Layer 0 with q rows numbered 0..127, k rows 1000..1063, v rows 2000..2063 (one value per row).
    state = read_hf_state_like(hf)
    qkv = hf_to_megatron(state, hf)["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    d, per_group = 32, 2  # 4 heads in 2 groups of head_dim 32
    group0 = list(range(0, per_group * d)) + list(range(1000, 1000 + d)) + list(range(2000, 2000 + d))
    assert qkv[: len(group0)] == group0
    assert qkv[len(group0) : len(group0) + 2] == [per_group * d, per_group * d + 1]  # group 1 starts with its q


def read_hf_state_like(hf) -> dict[str, torch.Tensor]:
    """A fake HF state dict of the right shapes whose q/k/v rows carry their row numbers."""
    h, n, f = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * hf["head_dim"]
    rows = lambda start, count: (torch.arange(count, dtype=torch.float32) + start)[:, None].expand(count, h)  # noqa: E731
    state = {
        "model.embed_tokens.weight": torch.zeros(hf["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": torch.zeros(hf["vocab_size"], h),
    }
    for i in range(n):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "self_attn.q_proj.weight": rows(0, hf["num_attention_heads"] * hf["head_dim"]),
                p + "self_attn.k_proj.weight": rows(1000, kv),
                p + "self_attn.v_proj.weight": rows(2000, kv),
                p + "self_attn.o_proj.weight": torch.zeros(h, h),
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
                p + "mlp.gate_proj.weight": torch.zeros(f, h),
                p + "mlp.up_proj.weight": torch.ones(f, h),
                p + "mlp.down_proj.weight": torch.zeros(h, f),
                p + "self_attn.q_norm.weight": torch.ones(hf["head_dim"]),
                p + "self_attn.k_norm.weight": torch.ones(hf["head_dim"]),
            }
        )
    return state

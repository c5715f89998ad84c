"""Qwen3.5-MoE (``qwen3_5_moe_text``) on the megatron backend: Gated DeltaNet linear attention
beside gated full attention, zero-centred RMSNorms, routed experts plus a gated shared expert.
The released checkpoints are multimodal (``qwen3_5_moe``); the functions here take their
language model's config (its ``text_config``: `megatron_convert.language_model_config`), whose
weights `megatron_convert` reads and writes under the checkpoint's own names.

The model is built from megatron-core's own modules without Transformer Engine (`block_spec`):
megatron-core's hybrid spec (``get_transformer_block_with_experimental_attention_variant_spec``)
requires Transformer Engine, so the same per-layer structure is assembled here from the local
layer spec the dense and MoE models use, each layer's attention being megatron-core's
``GatedDeltaNet`` or its ``SelfAttention`` with ``attention_output_gate``, then sliced to this
pipeline stage's layers.

Norms: Qwen3.5 stores its decoder, final and QK norms zero-centred (``(1 + w) * x / rms(x)``);
megatron-core's torch norm refuses ``layernorm_zero_centered_gamma``, so those norms compute
transformers' ``Qwen3_5MoeRMSNorm`` step for step behind megatron's constructor
(`ZeroCentredRMSNorm`; not that class itself, whose module takes seconds to import), and
the Gated DeltaNet output norm (a plain weight, gated by megatron-core) computes HF's
``Qwen3_5MoeRMSNormGated`` before its gate (`GatedOutputNorm`). Every weight is HF's as stored,
so conversion in either direction copies it.

Layouts of layer ``i`` (``qk``/``v`` the key/value widths, ``nv`` the value heads):

* Gated DeltaNet: HF ``linear_attn.in_proj_qkv`` [q, k, v], ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` <-> megatron ``self_attention.in_proj`` [q, k, v, z, b, a] (`in_proj_parts`:
  with tensor parallelism each rank holds its heads of each part, [q_r, k_r, v_r, z_r, b_r,
  a_r], `mark_fused_parts`); ``conv1d`` [q, k, v] channels (the same per part, `conv_parts`),
  ``A_log`` and ``dt_bias`` per value head (split by heads), ``norm`` <-> ``out_norm``,
  ``out_proj`` (row-parallel).
* Gated attention: HF ``q_proj`` gives per head [query, gate]; megatron's ``linear_qkv`` with an
  output gate is ordered by query group, [queries of the group, their gates, k, v] per group.
* The shared expert and its sigmoid gate: `services.trainer.backends.megatron_moe`.

Rotary embedding: Qwen3.5's interleaved multimodal rope is, for text (the three position ids
equal), plain rope on the first ``partial_rotary_factor`` of each head: megatron's
``rotary_percent``. Used by `megatron_convert` and `megatron_setup`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from services.trainer.backends.megatron_moe import mark_sequence_parallel
from shared.config_error import ConfigError

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

HYBRID_MODEL_TYPES = ("qwen3_5_moe_text",)
_TP_KEY = "policy.megatron_cfg.tensor_model_parallel_size"
# an attribute on a tensor-parallel parameter fused from parts that each split over the ranks:
# the parts' whole sizes (`megatron_tp` cuts, gathers and checkpoints it part by part)
FUSED_PARTS = "streamrl_fused_parts"


def is_hybrid(hf: dict[str, Any]) -> bool:
    """Whether the HF config has linear-attention layers (Qwen3.5)."""
    return hf.get("model_type") in HYBRID_MODEL_TYPES


def linear_attention_pattern(hf: dict[str, Any]) -> list[int]:
    """1 for a Gated DeltaNet layer, 0 for a full-attention one, from ``layer_types`` (or every
    ``full_attention_interval``-th layer full, as Qwen3.5's config derives it)."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        return [int((i + 1) % interval != 0) for i in range(layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"layer_types has {unknown}; the megatron backend builds linear and full attention layers")
    return [int(t == "linear_attention") for t in types]


def _linear_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(key width, value width, value heads) of a Gated DeltaNet layer, over all heads."""
    qk = int(hf["linear_key_head_dim"]) * int(hf["linear_num_key_heads"])
    v = int(hf["linear_value_head_dim"]) * int(hf["linear_num_value_heads"])
    return qk, v, int(hf["linear_num_value_heads"])


def in_proj_parts(hf: dict[str, Any]) -> tuple[int, ...]:
    """The whole sizes of ``in_proj``'s parts: q, k, v, z, b, a."""
    qk, v, nv = _linear_dims(hf)
    return (qk, qk, v, v, nv, nv)


def conv_parts(hf: dict[str, Any]) -> tuple[int, ...]:
    """The whole sizes of ``conv1d``'s channel parts: q, k, v."""
    qk, v, _ = _linear_dims(hf)
    return (qk, qk, v)


def check_layout(hf: dict[str, Any], tp: int) -> None:
    """Refuse a tensor-parallel size the linear-attention heads cannot split over, naming the key."""
    for key in ("linear_num_key_heads", "linear_num_value_heads", "num_key_value_heads"):
        if int(hf[key]) % tp:
            raise ConfigError(f"{_TP_KEY} is {tp}; it must divide the checkpoint's {hf[key]} {key}")
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias is true; the megatron backend builds Qwen3.5 without attention biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act is {hf['hidden_act']!r}; the megatron backend supports only 'silu'")


def config_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig arguments a Qwen3.5 checkpoint adds: the Gated DeltaNet layers and their
    pattern, the attention output gate."""
    return {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": linear_attention_pattern(hf),
        "linear_conv_kernel_dim": int(hf["linear_conv_kernel_dim"]),
        "linear_key_head_dim": int(hf["linear_key_head_dim"]),
        "linear_value_head_dim": int(hf["linear_value_head_dim"]),
        "linear_num_key_heads": int(hf["linear_num_key_heads"]),
        "linear_num_value_heads": int(hf["linear_num_value_heads"]),
        "attention_output_gate": True,
        "qk_layernorm": True,
    }


def rotary_percent(hf: dict[str, Any]) -> float:
    """The share of each attention head that rope rotates."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


class ZeroCentredRMSNorm(torch.nn.Module):  # type: ignore[misc]  # torch is skipped by mypy
    """transformers' Qwen3.5 RMSNorm, ``(1 + w) * x / rms(x)`` in float32 with the same steps, with
    megatron-core's norm constructor: the weight is HF's as stored, the output HF's bit for bit."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        mark_sequence_parallel(self.weight, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedOutputNorm(torch.nn.Module):  # type: ignore[misc]  # torch is skipped by mypy
    """The Gated DeltaNet output norm before megatron-core's gate: ``w * (x / rms(x))``, normalised
    in float32 and weighted in the input dtype, as HF's ``Qwen3_5MoeRMSNormGated`` computes it.
    It normalises this rank's value heads, so at tensor parallelism each rank's gradient of it is
    partial: marked as a sequence-parallel weight, whose gradients megatron-core sums over the
    tensor-parallel ranks (the backend trains these models at tensor parallelism only with
    sequence parallelism, `megatron_setup.uses_sequence_parallel`)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        mark_sequence_parallel(self.weight, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def block_spec(hf: dict[str, Any], config: TransformerConfig) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage's layers, as megatron-core's hybrid spec builds it
    but from local modules: each layer the local MoE layer spec with zero-centred norms, its
    attention a Gated DeltaNet or the gated self-attention, as ``layer_types`` says."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from services.trainer.backends import megatron_moe

    local = get_gpt_layer_local_spec(
        num_experts=megatron_moe.num_experts(hf), moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    full = copy.deepcopy(local)
    full.submodules.input_layernorm = ZeroCentredRMSNorm
    full.submodules.pre_mlp_layernorm = ZeroCentredRMSNorm
    full.submodules.self_attention.submodules.q_layernorm = ZeroCentredRMSNorm
    full.submodules.self_attention.submodules.k_layernorm = ZeroCentredRMSNorm
    linear = copy.deepcopy(full)
    linear.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm, out_proj=RowParallelLinear
        ),
    )
    layers = [linear if la else full for la in linear_attention_pattern(hf)]
    offset = get_transformer_layer_offset(config)
    mine = layers[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=mine, layer_norm=ZeroCentredRMSNorm)


def mark_fused_parts(model: torch.nn.Module, hf: dict[str, Any]) -> None:
    """Tell `megatron_tp` how the Gated DeltaNet parameters split over the tensor-parallel ranks:
    ``in_proj`` and ``conv1d`` part by part (`FUSED_PARTS`), ``conv1d``, ``A_log`` and
    ``dt_bias`` by rows (megatron-core marks them tensor-parallel without a ``partition_dim``)."""
    for name, param in model.named_parameters():
        if name.endswith("self_attention.in_proj.weight"):
            setattr(param, FUSED_PARTS, in_proj_parts(hf))
        elif name.endswith("self_attention.conv1d.weight"):
            setattr(param, FUSED_PARTS, conv_parts(hf))
        if name.endswith(("self_attention.conv1d.weight", "self_attention.A_log", "self_attention.dt_bias")):
            param.partition_dim = 0


def _gated_qkv_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads, groups = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    return heads // groups, groups, int(hf["head_dim"])


def attention_hf_to_megatron(state: Mapping[str, torch.Tensor], hf: dict[str, Any], i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s token mixer (Gated DeltaNet or gated attention) and its two norms in
    megatron-core naming and layout, whole (the MLP: `megatron_moe`)."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {
        m + "input_layernorm.weight": state[h + "input_layernorm.weight"],
        m + "pre_mlp_layernorm.weight": state[h + "post_attention_layernorm.weight"],
    }
    a, s = m + "self_attention.", h + "self_attn."
    if linear_attention_pattern(hf)[i]:
        la = h + "linear_attn."
        fused = [state[la + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]
        out[a + "in_proj.weight"] = torch.cat(fused)
        for name in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
            out[a + name] = state[la + name]
        out[a + "out_norm.weight"] = state[la + "norm.weight"]
        return out
    per_group, groups, d = _gated_qkv_dims(hf)
    q_and_gate = state[s + "q_proj.weight"].reshape(groups, per_group, 2, d, -1)
    q, gate = (q_and_gate[:, :, j].reshape(groups, per_group * d, -1) for j in (0, 1))
    k = state[s + "k_proj.weight"].reshape(groups, d, -1)
    v = state[s + "v_proj.weight"].reshape(groups, d, -1)
    out[a + "linear_qkv.weight"] = torch.cat([q, gate, k, v], dim=1).reshape(-1, q.shape[-1])
    out[a + "linear_proj.weight"] = state[s + "o_proj.weight"]
    out[a + "q_layernorm.weight"] = state[s + "q_norm.weight"]
    out[a + "k_layernorm.weight"] = state[s + "k_norm.weight"]
    return out


def attention_megatron_to_hf(state: Mapping[str, torch.Tensor], hf: dict[str, Any], i: int) -> dict[str, torch.Tensor]:
    """The inverse of `attention_hf_to_megatron`."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {
        h + "input_layernorm.weight": state[m + "input_layernorm.weight"],
        h + "post_attention_layernorm.weight": state[m + "pre_mlp_layernorm.weight"],
    }
    a, s = m + "self_attention.", h + "self_attn."
    if linear_attention_pattern(hf)[i]:
        la = h + "linear_attn."
        qkv, z, b, alpha = state[a + "in_proj.weight"].split([sum(conv_parts(hf)), *in_proj_parts(hf)[3:]])
        out.update({la + "in_proj_qkv.weight": qkv, la + "in_proj_z.weight": z})
        out.update({la + "in_proj_b.weight": b, la + "in_proj_a.weight": alpha})
        for name in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
            out[la + name] = state[a + name]
        out[la + "norm.weight"] = state[a + "out_norm.weight"]
        return out
    per_group, groups, d = _gated_qkv_dims(hf)
    qkv = state[a + "linear_qkv.weight"]
    qkv = qkv.reshape(groups, (2 * per_group + 2) * d, qkv.shape[-1])
    q, gate, k, v = qkv.split([per_group * d, per_group * d, d, d], dim=1)
    heads = [t.reshape(groups, per_group, d, -1) for t in (q, gate)]
    out[s + "q_proj.weight"] = torch.stack(heads, dim=2).reshape(-1, qkv.shape[-1])
    out[s + "k_proj.weight"] = k.reshape(-1, qkv.shape[-1])
    out[s + "v_proj.weight"] = v.reshape(-1, qkv.shape[-1])
    out[s + "o_proj.weight"] = state[a + "linear_proj.weight"]
    out[s + "q_norm.weight"] = state[a + "q_layernorm.weight"]
    out[s + "k_norm.weight"] = state[a + "k_layernorm.weight"]
    return out


# ---- packed rows through the Gated DeltaNet layers ------------------------------------------------
#
# Only two of a Gated DeltaNet layer's operations carry anything along the sequence: the short
# causal convolution and the gated delta rule's recurrent state; its projections, norms and gate
# are per token. Inside `linear_attention.rows_apart` those two run each row of a pack on its own
# (from a zero state), so no row reads the end of the one before it. Kept apart there, inside the
# layer, rather than around it: with sequence parallelism the layer's input is this rank's part of
# the sequence, and the rows are whole only after its input projection has gathered it.

_ROWS_APART = "_streamrl_rows_apart"


def separate_rows(model: torch.nn.Module) -> int:
    """Make the Gated DeltaNet layers of ``model`` honour `linear_attention.rows_apart` (see
    above); the number of layers. Doing it twice changes nothing."""
    from megatron.core.ssm import gated_delta_net

    for name in ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"):
        rule = getattr(gated_delta_net, name)
        if not getattr(rule, _ROWS_APART, False):
            setattr(gated_delta_net, name, _rule_by_rows(rule))
    fused_conv = gated_delta_net.causal_conv1d_fn  # causal-conv1d's kernel, where it is installed
    if fused_conv is not None and not getattr(fused_conv, _ROWS_APART, False):
        gated_delta_net.causal_conv1d_fn = _conv_by_rows(fused_conv, trim=False)
    layers = [m for m in model.modules() if isinstance(m, gated_delta_net.GatedDeltaNet)]
    for layer in layers:
        if not getattr(layer.conv1d.forward, _ROWS_APART, False):
            # nn.Conv1d pads both ends: each row's output is cut back to the row's length
            layer.conv1d.forward = _conv_by_rows(layer.conv1d.forward, trim=True)
    return len(layers)


def _marked(wrapped: Any) -> Any:
    setattr(wrapped, _ROWS_APART, True)
    return wrapped


def _conv_by_rows(conv: Any, *, trim: bool) -> Any:
    """A causal convolution over [B, C, T] run row by row along T within a pack."""
    from services.trainer.backends.linear_attention import row_bounds

    @functools.wraps(conv)
    def wrapped(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        bounds = row_bounds(x.shape[-1]) if x.shape[0] == 1 else None
        if bounds is None:
            return conv(x, *args, **kwargs)
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            out = conv(x[..., s:e].contiguous(), *args, **kwargs)
            outs.append(out[..., : e - s] if trim else out)
        return torch.cat(outs, dim=-1)

    return _marked(wrapped)


def _rule_by_rows(rule: Any) -> Any:
    """A gated delta rule over [B, T, heads, dim] run row by row along T within a pack, each row
    from a zero state."""
    from services.trainer.backends.linear_attention import row_bounds

    @functools.wraps(rule)
    def wrapped(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        g: torch.Tensor,
        beta: torch.Tensor,
        **kwargs: Any,
    ) -> Any:
        bounds = row_bounds(query.shape[1]) if query.shape[0] == 1 else None
        if bounds is None:
            return rule(query, key, value, *args, g=g, beta=beta, **kwargs)
        if args or kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise RuntimeError("a pack runs its rows from a zero state and keeps none")
        outs = [
            rule(
                *(t[:, s:e].contiguous() for t in (query, key, value)),
                g=g[:, s:e].contiguous(),
                beta=beta[:, s:e].contiguous(),
                **kwargs,
            )[0]
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(outs, dim=1), None

    return _marked(wrapped)

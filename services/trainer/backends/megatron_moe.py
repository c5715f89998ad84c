"""Qwen3-MoE on the megatron backend: the TransformerConfig arguments, the layer spec and the
HF <-> megatron-core layout of one decoder layer's MLP, with expert parallelism.

Called by `services.trainer.backends.megatron_adapter`, which converts attention, norms and
embeddings itself and asks this module for every layer's MLP (dense models included, so that one
call covers both).

Layouts of layer ``i``'s MLP (``F`` the expert width ``moe_intermediate_size``, ``E`` experts):

* HF on disk (what ``save_pretrained`` writes, vLLM and transformers read): the router
  ``model.layers.{i}.mlp.gate.weight`` [E, H] and one module per expert,
  ``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj}.weight`` [F, H] and ``.down_proj.weight``
  [H, F]. transformers 5 fuses the experts in memory (``mlp.experts.gate_up_proj`` [E, 2F, H],
  gate first, and ``mlp.experts.down_proj`` [E, H, F]) and converts on load and save;
  `mlp_hf_to_megatron` reads either form, `mlp_megatron_to_hf` writes the on-disk one.
* megatron-core (``moe_grouped_gemm`` off: one MLP module per local expert):
  ``decoder.layers.{i}.mlp.router.weight`` [E, H] and
  ``decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight`` [2F, H] (gate then up)
  and ``.linear_fc2.weight`` [H, F], for the experts of this expert-parallel rank only.
* Expert parallelism splits the experts in contiguous blocks, as megatron-core numbers them:
  global expert ``e`` lives on EP rank ``e // (E / ep_size)`` as local expert ``e % (E / ep_size)``.
  The router is replicated on every rank.
* A shared expert (Qwen3.5: every token through one more MLP, scaled by
  ``sigmoid(shared_expert_gate(x))``): ``model.layers.{i}.mlp.shared_expert.{gate_proj,up_proj,
  down_proj}.weight`` and ``mlp.shared_expert_gate.weight`` [1, H] <-> megatron-core's
  ``mlp.shared_experts.linear_fc1.weight`` (gate then up), ``.linear_fc2.weight`` and
  ``.gate_weight`` (``moe_shared_expert_gate``), split by tensor parallelism as a dense MLP is and
  whole on every expert-parallel rank.
* Dense layers (every layer of a dense model; ``mlp_only_layers`` and the layers that
  ``decoder_sparse_step`` skips in an MoE model) keep the dense layout, ``mlp.linear_fc1`` (gate
  then up) and ``mlp.linear_fc2`` <-> ``mlp.{gate_proj,up_proj,down_proj}``, on every rank.

Routing equals HF's: softmax over all experts, top-k, then renormalised over the k when
``norm_topk_prob`` is true, which is softmax over the k largest logits (megatron's post-softmax
routing); without renormalisation it is megatron's pre-softmax routing. Tokens are never dropped
(no capacity factor), as in HF and vLLM. The router runs in the model dtype, as HF and vLLM run it.

The load-balancing auxiliary loss is not trained: HF adds it only with ``output_router_logits``
(Qwen3-MoE checkpoints ship it off), and megatron-core's ``aux_loss`` is normalised differently
(per layer and divided by top-k, where HF pools all layers), so ``router_aux_loss_coef`` is not
wired; the router learns from the policy loss alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from shared.config_error import ConfigError

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe_text")
# MoE families whose shared expert is built (with its sigmoid gate); their routing always
# renormalises the top k (Qwen3.5's router has no norm_topk_prob)
_SHARED_EXPERT_MODEL_TYPES = ("qwen3_5_moe_text",)
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Config keys of shared (always active) experts, built for `_SHARED_EXPERT_MODEL_TYPES` only.
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "num_shared_experts", "n_shared_experts")
_EP_KEY = "policy.megatron_cfg.expert_model_parallel_size"


def is_moe(hf: dict[str, Any]) -> bool:
    """Whether the HF config (``config.json`` as a dict) is a mixture-of-experts model."""
    return hf.get("model_type") in MOE_MODEL_TYPES


def num_experts(hf: dict[str, Any]) -> int:
    """The number of routed experts. Qwen's checkpoints write ``num_experts``; transformers 5
    writes the same value as ``num_local_experts``."""
    return int(hf.get("num_experts", hf.get("num_local_experts", 0)))


def moe_layer_pattern(hf: dict[str, Any]) -> list[int]:
    """1 for each decoder layer with experts, 0 for a dense one, as HF's Qwen3MoeDecoderLayer
    decides: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
    layers = hf["num_hidden_layers"]
    if not is_moe(hf):
        return [0] * layers
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ConfigError(f"decoder_sparse_step is {step}; it must be at least 1")
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = num_experts(hf) > 0
    return [int(sparse and i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _experts_per_rank(hf: dict[str, Any], ep_size: int) -> int:
    experts = num_experts(hf)
    if ep_size < 1 or experts % ep_size:
        raise ConfigError(f"{_EP_KEY} is {ep_size}; it must divide the checkpoint's {experts} experts (num_experts)")
    return experts // ep_size


def moe_config_kwargs(hf: dict[str, Any], *, expert_parallel: int) -> dict[str, Any]:
    """TransformerConfig arguments an MoE checkpoint adds to `transformer_config_kwargs`' ({} for
    a dense one, which refuses expert parallelism)."""
    if not is_moe(hf):
        if expert_parallel != 1:
            raise ConfigError(f"{_EP_KEY} is {expert_parallel}; a dense checkpoint has no experts to split")
        return {}
    shared = hf["model_type"] in _SHARED_EXPERT_MODEL_TYPES
    for key in _SHARED_EXPERT_KEYS:
        if hf.get(key) and not shared:
            raise ConfigError(
                f"{key} is {hf[key]}: shared experts are supported by the megatron backend for Qwen3.5-MoE "
                f"only, not model_type {hf['model_type']!r}"
            )
    if num_experts(hf) < 1:
        raise ConfigError("num_experts must be at least 1 for a qwen3_moe checkpoint")
    _experts_per_rank(hf, expert_parallel)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act is {hf['hidden_act']!r}; the megatron backend supports only 'silu'")
    topk, renormalise = int(hf["num_experts_per_tok"]), shared or bool(hf.get("norm_topk_prob", False))
    if topk == 1 and renormalise:
        # Every token's one weight would be 1; megatron-core has no such routing.
        raise ConfigError("num_experts_per_tok 1 with norm_topk_prob true is not supported by the megatron backend")
    pattern = moe_layer_pattern(hf)
    if 0 in pattern and "intermediate_size" not in hf:
        raise ConfigError("intermediate_size is missing; the checkpoint has dense layers that need it")
    shared_kwargs = {}
    if shared and hf.get("shared_expert_intermediate_size"):
        shared_kwargs = {
            "moe_shared_expert_intermediate_size": int(hf["shared_expert_intermediate_size"]),
            "moe_shared_expert_gate": True,
        }
    return {
        **shared_kwargs,
        "ffn_hidden_size": hf.get("intermediate_size", hf["moe_intermediate_size"]),
        "num_moe_experts": num_experts(hf),
        "moe_layer_freq": pattern,
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_topk": topk,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not renormalise,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": expert_parallel,
        "expert_tensor_parallel_size": 1,
    }


class RMSNorm(torch.nn.RMSNorm):  # type: ignore[misc]  # torch is skipped by mypy
    """torch's RMSNorm behind megatron-core's norm constructor, as its ``WrappedTorchNorm`` builds
    it, but usable with sequence parallelism: its weight is marked ``sequence_parallel`` then, so
    megatron-core sums its gradient over the tensor-parallel ranks (each saw part of the
    sequence)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        mark_sequence_parallel(self.weight, config)


def mark_sequence_parallel(weight: torch.nn.Parameter, config: TransformerConfig) -> None:
    """Mark a weight every tensor-parallel rank holds whole and applies to its part of the sequence
    (a norm's), as megatron-core's own norms do."""
    weight.sequence_parallel = config.sequence_parallel


def mark_experts(model: torch.nn.Module) -> None:
    """Mark every routed expert's parameters as expert parameters (``allreduce`` false), at any
    expert-parallel size. megatron-core marks them so only under expert parallelism; without it
    they would count as dense parameters: their gradients reduced over the data ranks alone,
    where at tensor parallelism (experts whole on every tensor rank, `moe_config_kwargs`) each
    tensor rank's experts saw other tokens and the gradient must be reduced over the expert data
    ranks, tensor ranks included, as megatron-core's DDP does for expert parameters."""
    for name, param in model.named_parameters():
        if ".local_experts." in name:
            param.allreduce = False


def layer_spec(hf: dict[str, Any], config: TransformerConfig) -> TransformerBlockSubmodules:
    """The megatron-core local (no Transformer Engine) layers of this pipeline stage: dense layers,
    and MoE layers where ``moe_layer_freq`` puts experts, their norms `RMSNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    qk_norm = hf.get("model_type") in _QK_NORM_MODEL_TYPES
    specs = {}
    for moe in set(moe_layer_pattern(hf)):
        experts = {"num_experts": num_experts(hf), "moe_grouped_gemm": False} if moe else {}
        spec = get_gpt_layer_local_spec(**experts, qk_layernorm=qk_norm, normalization="RMSNorm")
        spec.submodules.input_layernorm = RMSNorm
        spec.submodules.pre_mlp_layernorm = RMSNorm
        if qk_norm:
            spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
            spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
        specs[moe] = spec
    layers = [specs[moe] for moe in moe_layer_pattern(hf)]
    offset = get_transformer_layer_offset(config)
    return TransformerBlockSubmodules(
        layer_specs=layers[offset : offset + get_num_layers_to_build(config)], layer_norm=RMSNorm
    )


def _hf_expert(
    state: Mapping[str, torch.Tensor], prefix: str, e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s gate, up and down weights, from the on-disk or the fused in-memory naming."""
    fused = prefix + "experts.gate_up_proj"
    if fused in state:
        gate, up = state[fused][e].chunk(2)
        return gate, up, state[prefix + "experts.down_proj"][e]
    p = f"{prefix}experts.{e}."
    return state[p + "gate_proj.weight"], state[p + "up_proj.weight"], state[p + "down_proj.weight"]


def mlp_hf_to_megatron(
    state: Mapping[str, torch.Tensor], hf: dict[str, Any], layer: int, *, ep_rank: int = 0, ep_size: int = 1
) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s MLP in megatron-core naming: the router and this EP rank's experts, or
    the dense MLP for a dense layer (the norm before it is not part of it)."""
    h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    if not moe_layer_pattern(hf)[layer]:
        return {
            m + "linear_fc1.weight": torch.cat([state[h + "gate_proj.weight"], state[h + "up_proj.weight"]]),
            m + "linear_fc2.weight": state[h + "down_proj.weight"],
        }
    per_rank = _experts_per_rank(hf, ep_size)
    out = {m + "router.weight": state[h + "gate.weight"]}
    if h + "shared_expert_gate.weight" in state:
        s = h + "shared_expert."
        fc1 = torch.cat([state[s + "gate_proj.weight"], state[s + "up_proj.weight"]])
        out[m + "shared_experts.linear_fc1.weight"] = fc1
        out[m + "shared_experts.linear_fc2.weight"] = state[s + "down_proj.weight"]
        out[m + "shared_experts.gate_weight"] = state[h + "shared_expert_gate.weight"]
    for j in range(per_rank):
        gate, up, down = _hf_expert(state, h, ep_rank * per_rank + j)
        out[f"{m}experts.local_experts.{j}.linear_fc1.weight"] = torch.cat([gate, up])
        out[f"{m}experts.local_experts.{j}.linear_fc2.weight"] = down
    return out


def mlp_megatron_to_hf(
    state: Mapping[str, torch.Tensor], hf: dict[str, Any], layer: int, *, ep_rank: int = 0, ep_size: int = 1
) -> dict[str, torch.Tensor]:
    """The inverse of `mlp_hf_to_megatron`, in the on-disk HF naming with global expert ids: the
    router and the experts of EP rank ``ep_rank`` (each rank returns the router)."""
    h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    out: dict[str, torch.Tensor] = {}
    if not moe_layer_pattern(hf)[layer]:
        out[h + "gate_proj.weight"], out[h + "up_proj.weight"] = state[m + "linear_fc1.weight"].chunk(2)
        out[h + "down_proj.weight"] = state[m + "linear_fc2.weight"]
    else:
        per_rank = _experts_per_rank(hf, ep_size)
        out[h + "gate.weight"] = state[m + "router.weight"]
        if m + "shared_experts.gate_weight" in state:
            s = h + "shared_expert."
            out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = state[
                m + "shared_experts.linear_fc1.weight"
            ].chunk(2)
            out[s + "down_proj.weight"] = state[m + "shared_experts.linear_fc2.weight"]
            out[h + "shared_expert_gate.weight"] = state[m + "shared_experts.gate_weight"]
        for j in range(per_rank):
            local, expert = f"{m}experts.local_experts.{j}.", f"{h}experts.{ep_rank * per_rank + j}."
            out[expert + "gate_proj.weight"], out[expert + "up_proj.weight"] = state[local + "linear_fc1.weight"].chunk(
                2
            )
            out[expert + "down_proj.weight"] = state[local + "linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}

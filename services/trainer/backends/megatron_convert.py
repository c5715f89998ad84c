"""Hugging Face <-> megatron-core GPTModel layouts for the megatron backend: the TransformerConfig
of a Qwen2/Qwen3/Qwen3-MoE/Qwen3.5-MoE config, the weights of each layer in either naming, and the HF
checkpoint read a tensor at a time.

Megatron fuses Q, K and V into one ``linear_qkv`` matrix ordered by query group ([q heads of the
group, k, v] per group) and gate/up into one ``linear_fc1``; an MoE layer's router and experts go
through `services.trainer.backends.megatron_moe`; Qwen3.5's linear and gated attention layers
through `services.trainer.backends.megatron_hybrid`. Conversion works a layer at a time
(`hf_layer_to_megatron`, `megatron_layer_to_hf`), so loading and publishing never hold more than a
layer beyond the rank's own part; `hf_to_megatron` / `megatron_to_hf` convert whole state dicts.
Used by `services.trainer.backends.megatron_adapter`.

A multimodal checkpoint whose language model the backend builds (the released Qwen3.5-MoE,
``Qwen3_5MoeForConditionalGeneration``: `MULTIMODAL_MODEL_TYPES`) keeps that model's config under
``text_config`` (`language_model_config`) and its weights under ``model.language_model.`` where a
text checkpoint has ``model.`` (`language_model_prefix`); ``lm_head.weight`` stays where it is.
Every HF-side function here takes that ``prefix`` and reads and writes the checkpoint's own names
with it, so nothing else restates where the language model lies. The rest of such a checkpoint
(its vision tower ``model.visual.*``, the MTP module ``mtp.*``) is not built; the adapter
publishes it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.trainer.backends import megatron_hybrid, megatron_moe
from shared.config_error import ConfigError
from shared.weights_format import safetensors_files


def _torch_backend_hint(model_type: Any) -> str:
    """Whether the torch backend (any causal LM transformers builds) can train ``model_type``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "the torch backend (trainer.backend: torch) builds it"
    return "no training backend here builds it"


# multimodal checkpoints whose language model (their text_config's model_type, checked as any other) the
# backend builds, stored under MULTIMODAL_PREFIX
MULTIMODAL_MODEL_TYPES = ("qwen3_5_moe",)
# where a text checkpoint stores the language model's ``model.*`` weights, and where a multimodal one does
TEXT_PREFIX, MULTIMODAL_PREFIX = "model.", "model.language_model."


def _is_multimodal(checkpoint: dict[str, Any]) -> bool:
    return "text_config" in checkpoint


def language_model_config(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The config of the model the backend builds from a checkpoint's ``config.json`` (as a dict):
    the file itself for a text checkpoint, its ``text_config`` for a multimodal one whose language
    model the backend builds (`MULTIMODAL_MODEL_TYPES`); any other multimodal checkpoint is
    refused by name."""
    if not _is_multimodal(checkpoint):
        return checkpoint
    if checkpoint.get("model_type") not in MULTIMODAL_MODEL_TYPES:
        raise ConfigError(
            "the megatron backend builds the language model of multimodal checkpoints of model_type "
            f"{', '.join(map(repr, MULTIMODAL_MODEL_TYPES))} only, not model_type {checkpoint.get('model_type')!r} "
            f"(architectures {checkpoint.get('architectures')}); " + _torch_backend_hint(checkpoint.get("model_type"))
        )
    text: dict[str, Any] = checkpoint["text_config"]
    return text


def language_model_prefix(checkpoint: dict[str, Any]) -> str:
    """Where the checkpoint stores the language model's ``model.*`` weights: ``model.`` in a text
    checkpoint, ``model.language_model.`` in a multimodal one."""
    return MULTIMODAL_PREFIX if _is_multimodal(checkpoint) else TEXT_PREFIX


def stored_name(name: str, prefix: str) -> str:
    """A language-model name (``model.*``, ``lm_head.weight``) as a checkpoint storing the model's
    ``model.*`` under ``prefix`` names it."""
    return prefix + name.removeprefix(TEXT_PREFIX) if name.startswith(TEXT_PREFIX) else name


class _UnderPrefix(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by their language-model names (``model.*`` read from under
    ``prefix``), each read when asked for."""

    def __init__(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._state, self._prefix = state, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._state[stored_name(key, self._prefix)]

    def __iter__(self) -> Iterator[str]:
        for name in self._state:
            if name.startswith(self._prefix):
                yield TEXT_PREFIX + name.removeprefix(self._prefix)
            elif not name.startswith(TEXT_PREFIX):
                yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _language_model(state: Mapping[str, torch.Tensor], prefix: str) -> Mapping[str, torch.Tensor]:
    """``state`` (a checkpoint storing the language model's ``model.*`` under ``prefix``) by
    language-model names."""
    return state if prefix == TEXT_PREFIX else _UnderPrefix(state, prefix)


def _as_stored(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Language-model names to the names a checkpoint with ``prefix`` stores them by."""
    return state if prefix == TEXT_PREFIX else {stored_name(k, prefix): v for k, v in state.items()}


def transformer_config_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig arguments for a Qwen2/Qwen3/Qwen3-MoE/Qwen3.5-MoE HF config (``config.json``
    as a dict, a multimodal checkpoint's `language_model_config`); an MoE checkpoint's expert
    settings come from `megatron_moe.moe_config_kwargs`."""
    if hf.get("model_type") not in ("qwen3", "qwen2", *megatron_moe.MOE_MODEL_TYPES):
        raise ConfigError(
            "the megatron backend builds Qwen2, Qwen3, Qwen3-MoE and Qwen3.5-MoE language models, not model_type "
            f"{hf.get('model_type')!r} (architectures {hf.get('architectures')}); "
            + _torch_backend_hint(hf.get("model_type"))
        )
    heads = hf["num_attention_heads"]
    hybrid = megatron_hybrid.config_kwargs(hf) if megatron_hybrid.is_hybrid(hf) else {}
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf.get("intermediate_size", hf.get("moe_intermediate_size")),
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "qk_layernorm": hf["model_type"] != "qwen2",
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": hf["model_type"] == "qwen2",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        **hybrid,
    }


def rope_base(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _qkv_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads // groups, groups, head_dim


# (HF name, megatron-core name) of the parameters outside the decoder layers
_GLOBALS = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
    ("lm_head.weight", "output_layer.weight"),
)


def hf_globals_to_megatron(
    state: Mapping[str, torch.Tensor],
    hf: dict[str, Any],
    *,
    first: bool = True,
    last: bool = True,
    prefix: str = TEXT_PREFIX,
) -> dict[str, torch.Tensor]:
    """The embedding (``first``: the pipeline stage that holds it), the final norm and the output
    layer (``last``) in megatron-core naming; only those are read (``prefix``: where ``state``
    stores the language model's ``model.*``)."""
    state = _language_model(state, prefix)
    tied = hf.get("tie_word_embeddings", False)
    return {
        m: state[h]
        for h, m in _GLOBALS
        if (first if m.startswith("embedding.") else last) and not (tied and m == "output_layer.weight")
    }


def hf_layer_to_megatron(
    state: Mapping[str, torch.Tensor],
    hf: dict[str, Any],
    i: int,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    prefix: str = TEXT_PREFIX,
) -> dict[str, torch.Tensor]:
    """Decoder layer ``i`` in megatron-core naming and layout (its MLP: `megatron_moe`; Qwen3.5's
    attention: `megatron_hybrid`), read from ``state`` storing the language model under ``prefix``."""
    state = _language_model(state, prefix)
    if megatron_hybrid.is_hybrid(hf):
        mixer = megatron_hybrid.attention_hf_to_megatron(state, hf, i)
        return {**mixer, **megatron_moe.mlp_hf_to_megatron(state, hf, i, ep_rank=ep_rank, ep_size=ep_size)}
    per_group, groups, d = _qkv_dims(hf)
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    q = state[h + "self_attn.q_proj.weight"].reshape(groups, per_group * d, -1)
    k = state[h + "self_attn.k_proj.weight"].reshape(groups, d, -1)
    v = state[h + "self_attn.v_proj.weight"].reshape(groups, d, -1)
    out = {
        m + "self_attention.linear_qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1]),
        m + "self_attention.linear_proj.weight": state[h + "self_attn.o_proj.weight"],
        m + "input_layernorm.weight": state[h + "input_layernorm.weight"],
        m + "pre_mlp_layernorm.weight": state[h + "post_attention_layernorm.weight"],
    }
    if h + "self_attn.q_norm.weight" in state:
        out[m + "self_attention.q_layernorm.weight"] = state[h + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = state[h + "self_attn.k_norm.weight"]
    if h + "self_attn.q_proj.bias" in state:
        qb = state[h + "self_attn.q_proj.bias"].reshape(groups, per_group * d)
        kb = state[h + "self_attn.k_proj.bias"].reshape(groups, d)
        vb = state[h + "self_attn.v_proj.bias"].reshape(groups, d)
        out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
    out.update(megatron_moe.mlp_hf_to_megatron(state, hf, i, ep_rank=ep_rank, ep_size=ep_size))
    return out


def hf_to_megatron(
    state: Mapping[str, torch.Tensor],
    hf: dict[str, Any],
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    prefix: str = TEXT_PREFIX,
) -> dict[str, torch.Tensor]:
    """An HF Qwen state dict (the language model's ``model.*`` under ``prefix``) in megatron-core
    GPTModel naming and layout: Q, K and V fused into ``linear_qkv`` ordered by query group ([q
    heads of the group, k, v] per group), gate/up into ``linear_fc1``; with expert parallelism,
    the experts of EP rank ``ep_rank`` only."""
    out = hf_globals_to_megatron(state, hf, prefix=prefix)
    for i in range(hf["num_hidden_layers"]):
        out.update(hf_layer_to_megatron(state, hf, i, ep_rank=ep_rank, ep_size=ep_size, prefix=prefix))
    return out


def megatron_globals_to_hf(state: Mapping[str, torch.Tensor], prefix: str = TEXT_PREFIX) -> dict[str, torch.Tensor]:
    """The inverse of `hf_globals_to_megatron`, for the globals ``state`` holds."""
    return _as_stored({h: state[m] for h, m in _GLOBALS if m in state}, prefix)


def megatron_layer_to_hf(
    state: Mapping[str, torch.Tensor],
    hf: dict[str, Any],
    i: int,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    prefix: str = TEXT_PREFIX,
) -> dict[str, torch.Tensor]:
    """The inverse of `hf_layer_to_megatron` (the experts of EP rank ``ep_rank``), named as a
    checkpoint storing the language model under ``prefix`` names them."""
    if megatron_hybrid.is_hybrid(hf):
        mixer = megatron_hybrid.attention_megatron_to_hf(state, hf, i)
        mlp = megatron_moe.mlp_megatron_to_hf(state, hf, i, ep_rank=ep_rank, ep_size=ep_size)
        return _as_stored({k: v.contiguous() for k, v in {**mixer, **mlp}.items()}, prefix)
    per_group, groups, d = _qkv_dims(hf)
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    qkv = state[m + "self_attention.linear_qkv.weight"]
    qkv = qkv.reshape(groups, (per_group + 2) * d, qkv.shape[-1])
    out = {
        h + "self_attn.q_proj.weight": qkv[:, : per_group * d].reshape(-1, qkv.shape[-1]),
        h + "self_attn.k_proj.weight": qkv[:, per_group * d : (per_group + 1) * d].reshape(-1, qkv.shape[-1]),
        h + "self_attn.v_proj.weight": qkv[:, (per_group + 1) * d :].reshape(-1, qkv.shape[-1]),
        h + "self_attn.o_proj.weight": state[m + "self_attention.linear_proj.weight"],
        h + "input_layernorm.weight": state[m + "input_layernorm.weight"],
        h + "post_attention_layernorm.weight": state[m + "pre_mlp_layernorm.weight"],
    }
    if m + "self_attention.q_layernorm.weight" in state:
        out[h + "self_attn.q_norm.weight"] = state[m + "self_attention.q_layernorm.weight"]
        out[h + "self_attn.k_norm.weight"] = state[m + "self_attention.k_layernorm.weight"]
    if m + "self_attention.linear_qkv.bias" in state:
        b = state[m + "self_attention.linear_qkv.bias"].reshape(groups, (per_group + 2) * d)
        out[h + "self_attn.q_proj.bias"] = b[:, : per_group * d].reshape(-1)
        out[h + "self_attn.k_proj.bias"] = b[:, per_group * d : (per_group + 1) * d].reshape(-1)
        out[h + "self_attn.v_proj.bias"] = b[:, (per_group + 1) * d :].reshape(-1)
    out.update(megatron_moe.mlp_megatron_to_hf(state, hf, i, ep_rank=ep_rank, ep_size=ep_size))
    return _as_stored({k: v.contiguous() for k, v in out.items()}, prefix)


def megatron_to_hf(
    state: Mapping[str, torch.Tensor],
    hf: dict[str, Any],
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    prefix: str = TEXT_PREFIX,
) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron` (``_extra_state`` entries are ignored)."""
    out = megatron_globals_to_hf(state, prefix)
    for i in range(hf["num_hidden_layers"]):
        out.update(megatron_layer_to_hf(state, hf, i, ep_rank=ep_rank, ep_size=ep_size, prefix=prefix))
    return {k: v.contiguous() for k, v in out.items()}


def padded_vocab(hf: dict[str, Any]) -> int:
    """The vocabulary rounded up to a multiple of `VOCAB_MULTIPLE`, so the vocabulary-parallel
    embedding and output layer split evenly at any tensor-parallel size that divides it; the
    same at every size, so checkpoints move between sizes."""
    return -(-int(hf["vocab_size"]) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


VOCAB_MULTIPLE = 128


class SafetensorsState(Mapping[str, torch.Tensor]):
    """An HF checkpoint's tensors by name, each read from its file when asked for (so converting
    layer by layer holds one layer, not the model)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        for f in safetensors_files(Path(model_dir)):
            handle: Any = safe_open(str(f), framework="pt")
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._where[key].get_tensor(key)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return dict(SafetensorsState(model_dir))

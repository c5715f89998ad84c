"""Model FLOPs of a training step, and the model FLOPs utilisation (MFU) of the trainer's devices.

    per token, forward + backward:  6 x N  +  12 x L_attn x (heads x head_dim) x S
      N        the matrix parameters one token passes through: attention (or linear-attention)
               projections, the MLP or the experts it is routed to (top-k of the routed experts, the
               shared expert, the router), the LM head; not the input embedding (a lookup)
      L_attn   the layers with softmax attention: a Qwen3.5 / Qwen3-Next linear-attention (Gated
               DeltaNet) layer has no quadratic term (its recurrent state update is not counted)
      S        the length of the token's sequence
    a step:   sum over the trained sequences of S x flops_per_token(S)
    MFU:      step FLOPs / (train seconds x trainer devices x peak FLOP/s per device)

The attention term is PaLM's (appendix B of the PaLM paper), counted without the causal half, as
Megatron and torchtitan report it. Padding, the old-policy and reference forwards and recomputed
activations are not model FLOPs: the MFU of a step that runs them reads lower than the hardware's
busy time. The peak per device is ``trainer.peak_tflops_per_device``, else the dense figure of
`PEAK_TFLOPS` for the GPU's name at ``policy.precision``; a CPU has no published peak, so its MFU
stays null unless configured.

`MfuMeter.from_config` is built once by the control plane; `MfuMeter.measure` runs per step
(`services.trainer.step_record`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.run_config import RunConfig

log = logging.getLogger(__name__)

# Dense (no sparsity) peak TFLOP/s per device from the vendors' data sheets: (name parts, bfloat16,
# float32 without TF32). The first row whose parts all occur in the lower-cased device name wins.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float, float], ...] = (
    (("h100", "pcie"), 756.0, 51.0),
    (("h100", "nvl"), 835.0, 60.0),
    (("h100",), 989.0, 67.0),  # SXM
    (("h200",), 989.0, 67.0),
    (("a100",), 312.0, 19.5),
    (("l40s",), 362.0, 91.6),
)
# Model types whose softmax attention gates its output: q_proj is twice as wide.
GATED_ATTENTION = ("qwen3_next", "qwen3_5")


@dataclass(frozen=True)
class ModelFlops:
    """A model's shape as the FLOPs formula sees it (`model_flops`)."""

    active_params: int  # N: matrix parameters per token (active experts only, LM head in)
    attention_layers: int  # layers with softmax attention
    attention_width: int  # heads x head_dim of those layers

    def per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one token of a ``seq_len``-token sequence."""
        return 6.0 * self.active_params + 12.0 * self.attention_layers * self.attention_width * seq_len

    def of_sequences(self, seq_lens: Sequence[int]) -> float:
        """Forward + backward FLOPs of training on sequences of these lengths."""
        return sum(s * self.per_token(s) for s in seq_lens)


def flops_per_token(config: Mapping[str, Any] | Any, seq_len: int) -> float:
    """Forward + backward model FLOPs of one token at sequence length ``seq_len`` for a
    transformers config (object or dict)."""
    return model_flops(config).per_token(seq_len)


def model_flops(config: Mapping[str, Any] | Any) -> ModelFlops:
    """The FLOPs shape of a decoder-only transformers config (object or its dict): dense
    (Llama, Qwen2/3), MoE (Qwen3-MoE, Mixtral), hybrid (Qwen3.5, Qwen3-Next); a multimodal
    config is read through its ``text_config``. A missing key is a ValueError naming it."""
    outer = dict(config) if isinstance(config, Mapping) else config.to_dict()
    c = dict(outer.get("text_config") or outer)
    h, layers, vocab = _int(c, "hidden_size"), _int(c, "num_hidden_layers"), _int(c, "vocab_size")
    heads = _int(c, "num_attention_heads")
    head_dim = int(c.get("head_dim") or h // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    gate = 2 if str(c.get("model_type") or outer.get("model_type") or "").startswith(GATED_ATTENTION) else 1
    attention = h * heads * head_dim * (gate + 1) + 2 * h * kv_heads * head_dim
    full = sum(t != "linear_attention" for t in _layer_types(c, layers))
    n = full * attention + ((layers - full) * _linear_attention(c, h) if full < layers else 0)
    n += sum(_mlp(c, h, i) for i in range(layers))
    n += h * vocab  # the LM head (tied or not: it is a matmul either way)
    return ModelFlops(active_params=n, attention_layers=full, attention_width=heads * head_dim)


def _layer_types(c: dict[str, Any], layers: int) -> list[str]:
    """Each layer's attention: ``layer_types``, else every ``full_attention_interval``-th layer
    full and the rest linear (a hybrid config.json may give only the interval), else all full."""
    if c.get("layer_types"):
        return list(c["layer_types"])[:layers]
    interval = int(c.get("full_attention_interval") or 1)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _int(c: dict[str, Any], key: str) -> int:
    if not c.get(key):
        raise ValueError(f"the model config has no {key!r}: its FLOPs per token are unknown")
    return int(c[key])


def _linear_attention(c: dict[str, Any], h: int) -> int:
    """A Gated DeltaNet layer's projections (q, k, v, z, a, b in; out) and its depthwise conv."""
    key = _int(c, "linear_num_key_heads") * _int(c, "linear_key_head_dim")
    nv = _int(c, "linear_num_value_heads")
    value = nv * _int(c, "linear_value_head_dim")
    conv = (2 * key + value) * int(c.get("linear_conv_kernel_dim") or 4)
    return h * (2 * key + 2 * value + 2 * nv) + value * h + conv


def _mlp(c: dict[str, Any], h: int, layer: int) -> int:
    """Layer ``layer``'s MLP as one token sees it: gate, up and down of the dense MLP, or of the
    top-k routed experts plus the shared expert and the router."""
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
    step = int(c.get("decoder_sparse_step") or 1)
    dense_layer = layer in (c.get("mlp_only_layers") or []) or (layer + 1) % step != 0
    if not experts or dense_layer or layer < int(c.get("first_k_dense_replace") or 0):
        return 3 * h * _int(c, "intermediate_size")
    expert_size = int(c.get("moe_intermediate_size") or _int(c, "intermediate_size"))
    top_k = _int(c, "num_experts_per_tok")
    shared = int(c.get("shared_expert_intermediate_size") or 0)
    shared += int(c.get("n_shared_experts") or 0) * expert_size
    shared_gate = h if c.get("shared_expert_intermediate_size") else 0  # Qwen's sigmoid gate of the shared expert
    return 3 * h * expert_size * top_k + 3 * h * shared + h * experts + shared_gate


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of a device by its name (torch.cuda.get_device_name) at
    ``precision`` (bfloat16 | float32); None for a device not in `PEAK_TFLOPS`."""
    name = device_name.lower()
    for parts, bf16, fp32 in PEAK_TFLOPS:
        if all(p in name for p in parts):
            return bf16 if precision == "bfloat16" else fp32
    return None


def _device_name() -> str:
    """This process's accelerator, by name; "cpu" without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _load_config(model: str) -> dict[str, Any]:
    """The policy's config.json: read from its folder, else from the local Hugging Face cache."""
    if not model:
        raise ValueError("policy.model_name is empty")
    path = Path(model) / "config.json"
    if path.is_file():
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    from transformers import AutoConfig

    return dict(AutoConfig.from_pretrained(model, local_files_only=True).to_dict())


@dataclass(frozen=True)
class MfuMeter:
    """The trainer's model FLOPs per step, against the peak of its devices."""

    flops: ModelFlops | None  # None: the model's shape is unknown (no model_tflops, no mfu)
    devices: int  # trainer ranks: one device each
    peak_tflops: float | None  # per device; None: unknown (no mfu)

    @classmethod
    def from_config(cls, cfg: RunConfig, devices: int, device_name: str | None = None) -> MfuMeter:
        flops: ModelFlops | None = None
        try:
            flops = model_flops(_load_config(cfg.policy.model_name))
        except Exception as exc:  # a figure of the records: it never stops the trainer
            log.warning("model_tflops and mfu are not recorded: %s: %s", type(exc).__name__, exc)
        name = device_name if device_name is not None else _device_name()
        peak = cfg.trainer.peak_tflops_per_device or peak_tflops(name, cfg.policy.precision)
        if peak is None and flops is not None:
            log.info(
                "mfu is not recorded: no known peak for %s at %s (set trainer.peak_tflops_per_device)",
                name,
                cfg.policy.precision,
            )
        elif flops is not None:
            log.info(
                "mfu: %.3g GFLOP per token at 1024 tokens, against %.0f TFLOP/s per device x %d (%s)",
                flops.per_token(1024) / 1e9,
                peak,
                devices,
                name,
            )
        return cls(flops=flops, devices=devices, peak_tflops=peak)

    def measure(self, seq_lens: Sequence[int], train_s: float) -> tuple[float | None, float | None]:
        """(achieved TFLOP/s per device, MFU) of training sequences of ``seq_lens`` tokens in
        ``train_s`` seconds; None where the shape or the peak is unknown or nothing trained."""
        if self.flops is None or train_s <= 0 or not seq_lens:
            return None, None
        tflops = self.flops.of_sequences(seq_lens) / train_s / self.devices / 1e12
        return tflops, (tflops / self.peak_tflops if self.peak_tflops else None)

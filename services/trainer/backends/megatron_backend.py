"""The megatron-core training backend (``trainer.backend: megatron``; the ``megatron`` extra).

The policy is a megatron-core ``GPTModel`` built from the Hugging Face config of a Qwen3-family
checkpoint (RMSNorm, QK-norm, SwiGLU, RoPE, grouped-query attention, untied embeddings), wrapped
in megatron-core's ``DistributedDataParallel``. ``policy.megatron_cfg.distributed_data_parallel_config``
is passed through to ``DistributedDataParallelConfig`` field by field (an unknown field is an error
naming it); ``check_for_nan_in_grad`` stays on unless the config sets it to false.

Weights move between the two layouts with `hf_to_megatron` / `megatron_to_hf`: Megatron fuses
Q, K and V into one ``linear_qkv`` matrix ordered by query group ([q heads of the group, k, v] per
group) and gate/up into one ``linear_fc1``. Loading reads the HF safetensors; ``save_weights``
writes HF safetensors plus the HF config, so generators load Megatron-trained weights unchanged.

Everything else (micro-batching, packing, the loss, sequence-error masking, normalisation after
masking, metrics) is the torch backend's: this class overrides how the model is built, run and
saved, and how gradients are gathered (the DDP grad buffers). One process for now (the trainer
refuses WORLD_SIZE > 1 until its learner spans ranks), with DDP set up the way one rank per GPU
under torchrun needs it; tensor, pipeline and expert parallelism and sequence packing are not
wired yet (`check_supported` refuses them, naming the key).
It runs on CPU too (`services.trainer.backends.megatron_cpu`: megatron-core's CUDA-only calls),
where the backend contract test trains, checkpoints and resumes it and checks it trains the same
steps as the torch backend; scripts/gpu_check_megatron.sh checks it on a GPU.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from services.trainer.backends import megatron_cpu
from services.trainer.backends.torch_backend import TorchBackend
from shared.config_error import ConfigError
from shared.run_config import MegatronSection, PolicySection
from shared.weights_format import safetensors_files

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel

log = logging.getLogger(__name__)

_DDP_KEY = "policy.megatron_cfg.distributed_data_parallel_config"


def ddp_config(cfg: MegatronSection) -> DistributedDataParallelConfig:
    """megatron-core DistributedDataParallelConfig from the run config (nan check on by default)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = DistributedDataParallelConfig.__dataclass_fields__
    for key in cfg.distributed_data_parallel_config:
        if key not in fields:
            raise ConfigError(f"{_DDP_KEY}.{key} is not a field of megatron.core DistributedDataParallelConfig")
    values = {"check_for_nan_in_grad": True, **cfg.distributed_data_parallel_config}
    return DistributedDataParallelConfig(**values)


def transformer_config_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig arguments for a Qwen3-family HF config (``config.json`` as a dict)."""
    if hf.get("model_type") not in ("qwen3", "qwen2"):
        raise ConfigError(
            f"the megatron backend supports Qwen2/Qwen3 checkpoints, not model_type {hf.get('model_type')!r}"
        )
    heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "qk_layernorm": hf["model_type"] == "qwen3",
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": hf["model_type"] == "qwen2",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }


def rope_base(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _qkv_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads // groups, groups, head_dim


def hf_to_megatron(state: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An HF Qwen state dict in megatron-core GPTModel naming and layout."""
    per_group, groups, d = _qkv_dims(hf)
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
        "output_layer.weight": state["lm_head.weight"],
    }
    for i in range(hf["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = state[h + "self_attn.q_proj.weight"].reshape(groups, per_group * d, -1)
        k = state[h + "self_attn.k_proj.weight"].reshape(groups, d, -1)
        v = state[h + "self_attn.v_proj.weight"].reshape(groups, d, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[m + "self_attention.linear_proj.weight"] = state[h + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = state[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = state[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [state[h + "mlp.gate_proj.weight"], state[h + "mlp.up_proj.weight"]]
        )
        out[m + "mlp.linear_fc2.weight"] = state[h + "mlp.down_proj.weight"]
        if h + "self_attn.q_norm.weight" in state:
            out[m + "self_attention.q_layernorm.weight"] = state[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = state[h + "self_attn.k_norm.weight"]
        if h + "self_attn.q_proj.bias" in state:
            qb = state[h + "self_attn.q_proj.bias"].reshape(groups, per_group * d)
            kb = state[h + "self_attn.k_proj.bias"].reshape(groups, d)
            vb = state[h + "self_attn.v_proj.bias"].reshape(groups, d)
            out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron` (``_extra_state`` entries are ignored)."""
    per_group, groups, d = _qkv_dims(hf)
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": state["output_layer.weight"],
    }
    for i in range(hf["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"]
        qkv = qkv.reshape(groups, (per_group + 2) * d, qkv.shape[-1])
        out[h + "self_attn.q_proj.weight"] = qkv[:, : per_group * d].reshape(-1, qkv.shape[-1])
        out[h + "self_attn.k_proj.weight"] = qkv[:, per_group * d : (per_group + 1) * d].reshape(-1, qkv.shape[-1])
        out[h + "self_attn.v_proj.weight"] = qkv[:, (per_group + 1) * d :].reshape(-1, qkv.shape[-1])
        out[h + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
        if m + "self_attention.q_layernorm.weight" in state:
            out[h + "self_attn.q_norm.weight"] = state[m + "self_attention.q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = state[m + "self_attention.k_layernorm.weight"]
        if m + "self_attention.linear_qkv.bias" in state:
            b = state[m + "self_attention.linear_qkv.bias"].reshape(groups, (per_group + 2) * d)
            out[h + "self_attn.q_proj.bias"] = b[:, : per_group * d].reshape(-1)
            out[h + "self_attn.k_proj.bias"] = b[:, per_group * d : (per_group + 1) * d].reshape(-1)
            out[h + "self_attn.v_proj.bias"] = b[:, (per_group + 1) * d :].reshape(-1)
    return {k: v.contiguous() for k, v in out.items()}


_NOT_YET = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def check_supported(policy: PolicySection) -> None:
    """Refuse what the backend cannot do yet, naming the key, instead of silently training without it."""
    for key in _NOT_YET:
        value = getattr(policy.megatron_cfg, key)
        if value != 1:
            raise ConfigError(f"policy.megatron_cfg.{key} is {value}; the megatron backend supports only 1 so far")
    if policy.sequence_packing.enabled:
        raise ConfigError("policy.sequence_packing.enabled is not supported by the megatron backend yet")


def init_distributed(tensor_parallel: int, seed: int) -> None:
    """torch.distributed (torchrun's environment, or a single local rank), Megatron's groups and
    its model-parallel RNG (`services.trainer.backends.megatron_cpu`: on CPU too)."""
    from megatron.core import parallel_state

    if tensor_parallel != 1:
        raise ConfigError("policy.megatron_cfg.tensor_model_parallel_size must be 1 for now")
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(
            backend, rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1))
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    megatron_cpu.prepare(seed)


def build_gpt_model(hf: dict[str, Any], dtype: torch.dtype, *, cpu_init: bool = False) -> GPTModel:
    """A megatron-core GPTModel with the architecture of ``hf`` (random weights)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(hf)
    config = TransformerConfig(
        **kwargs, params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=cpu_init
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=kwargs["qk_layernorm"], normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=rope_base(hf),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )


def read_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(Path(model_dir)):
        state.update(load_file(str(f)))
    return state


class MegatronBackend(TorchBackend):
    name = "megatron"

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel

        check_supported(self.policy)
        init_distributed(self.policy.megatron_cfg.tensor_model_parallel_size, self.seed)
        self.hf_config = json.loads((Path(self.policy.model_name) / "config.json").read_text())
        model = build_gpt_model(self.hf_config, self.dtype).to(self.device)
        megatron_state = hf_to_megatron(read_hf_state(self.policy.model_name), self.hf_config)
        missing, unexpected = model.load_state_dict(megatron_state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit the Megatron model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        self._ddp_config = ddp_config(self.policy.megatron_cfg)
        return DistributedDataParallel(config=model.config, ddp_config=self._ddp_config, module=model)

    def _pad_token_id(self) -> int:
        return int(self.hf_config.get("pad_token_id") or 0)

    def _checkpointed_module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.model.module  # DDP's state dict is its module's, unprefixed
        return module

    def _forward_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Right padding only follows real tokens, so the causal mask alone keeps real tokens exact.
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        mask = megatron_cpu.causal_mask(input_ids.shape[1], input_ids.device)
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)

    def _zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def _grads_ready(self) -> None:
        # DDP accumulates into main_grad buffers and reduces them here; the optimizer reads .grad.
        self.model.finish_grad_sync()
        for p in self.model.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.to(p.dtype)

    def save_weights(self, out_dir: Path) -> dict[str, str]:
        """The HF weights through the torch backend's hashed writer (one rank); their digests."""
        from services.trainer.weight_export import ShardWriter

        module = self.model.module
        state = {k: v.detach().cpu() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
        out_dir = Path(out_dir)
        writer = ShardWriter(out_dir, self.max_weight_file_bytes)
        for name, tensor in megatron_to_hf(state, self.hf_config).items():
            writer.add(name, tensor)
        writer.close()
        (out_dir / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        src = Path(self.policy.model_name)
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (src / name).is_file():
                (out_dir / name).write_bytes((src / name).read_bytes())
        return writer.manifest

"""FSDP2 sharding of a Hugging Face causal LM over the trainer's ranks: each decoder layer, then
the root, ``fully_shard``-ed over a one-dimensional device mesh of every rank, with compute in the
policy's precision and gradients reduced in float32 (`policy.dtensor_cfg`: CPU offload on GPUs).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.trainer.ranks import Ranks

log = logging.getLogger(__name__)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one: the module list holding
    ``config.num_hidden_layers`` entries (``model.layers`` in Qwen, Llama, Mistral...)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return list(m)
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__} to shard")


def shard_model(model: torch.nn.Module, ranks: Ranks, dtype: torch.dtype, *, cpu_offload: bool) -> torch.nn.Module:
    """``model`` sharded in place over ``ranks`` (float32 master weights, ``dtype`` compute)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if cpu_offload and ranks.device.type == "cpu":
        log.warning("policy.dtensor_cfg.cpu_offload has nothing to do on CPU ranks: the shards live in host memory")
        cpu_offload = False
    kwargs: dict[str, Any] = {
        "mesh": ranks.mesh(),
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model

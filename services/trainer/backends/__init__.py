"""Training backends: one step runner (`backend.Backend`) composed with the model adapter that
``trainer.backend`` names, from this registry (as generator engines are chosen by
``policy.generation.backend``):

* ``torch``: a transformers causal LM in plain torch, sharded with FSDP2 over many ranks
  (`hf_adapter.HFAdapter`);
* ``megatron``: megatron-core's GPTModel with its DistributedDataParallel (the ``megatron``
  extra), built from a Qwen2/Qwen3/Qwen3-MoE Hugging Face checkpoint, split over tensor-,
  pipeline-, expert- and data-parallel ranks (`megatron_adapter.MegatronAdapter`).

Each adapter is imported only when chosen (torch and megatron-core are heavy). Both run on one
rank or many (`services.trainer.ranks`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from services.trainer.ranks import SINGLE, Ranks
from shared.config_error import ConfigError
from shared.run_config import RunConfig

if TYPE_CHECKING:
    from services.trainer.backends.adapter import ModelAdapter
    from services.trainer.backends.backend import Backend

# name -> "module:class"
ADAPTERS: dict[str, str] = {
    "torch": "services.trainer.backends.hf_adapter:HFAdapter",
    "megatron": "services.trainer.backends.megatron_adapter:MegatronAdapter",
}


class AdapterFactory(Protocol):
    def from_config(self, cfg: RunConfig, ranks: Ranks) -> ModelAdapter:
        """The adapter for ``cfg``'s policy on ``ranks`` (its layout computed; no model built)."""
        ...


def adapter_class(name: str) -> AdapterFactory:
    try:
        module, cls = ADAPTERS[name].split(":")
    except KeyError:
        raise ConfigError(f"trainer.backend {name!r} is not one of: {', '.join(sorted(ADAPTERS))}") from None
    found: AdapterFactory = getattr(importlib.import_module(module), cls)
    return found


def build_backend(
    cfg: RunConfig,
    ranks: Ranks = SINGLE,
    *,
    adapter: ModelAdapter | None = None,
    max_weight_file_bytes: int | None = None,
) -> Backend:
    """The backend ``trainer.backend`` names, as one rank of ``ranks``, with the policy loaded
    (slow: call in a thread). ``adapter``: one the caller built with settings of its own (the
    benchmarks read the checkpoint whole, for one); ``max_weight_file_bytes``: the size of the
    published weight files (512 MiB by default)."""
    import torch

    from services.trainer.backends.backend import Backend
    from services.trainer.weight_export import DEFAULT_MAX_SHARD_BYTES

    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.run.seed)
    if adapter is None:
        adapter = adapter_class(cfg.trainer.backend).from_config(cfg, ranks)
    return Backend(adapter, cfg, max_weight_file_bytes=max_weight_file_bytes or DEFAULT_MAX_SHARD_BYTES)

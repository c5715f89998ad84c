"""Training backends, chosen by ``trainer.backend`` from a registry behind the `TrainingBackend`
protocol (`base`), as generator engines are chosen by ``policy.generation.backend``:

* ``torch``: a transformers causal LM in plain torch, sharded with FSDP2 over many ranks;
* ``megatron``: megatron-core's GPTModel with its DistributedDataParallel (the ``megatron``
  extra), built from a Qwen2/Qwen3/Qwen3-MoE Hugging Face checkpoint, split over tensor-,
  expert- and data-parallel ranks.

Each entry is imported only when chosen (torch and megatron-core are heavy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.trainer.backends.base import TrainingBackend
from shared.config_error import ConfigError
from shared.run_config import RunConfig

if TYPE_CHECKING:
    from services.trainer.backends.torch_backend import TorchBackend
    from services.trainer.ranks import Ranks

# name -> "module:class"
BACKENDS: dict[str, str] = {
    "torch": "services.trainer.backends.torch_backend:TorchBackend",
    "megatron": "services.trainer.backends.megatron_backend:MegatronBackend",
}


def backend_class(name: str) -> type[TrainingBackend]:
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        raise ConfigError(f"trainer.backend {name!r} is not one of: {', '.join(sorted(BACKENDS))}") from None
    found: type[TrainingBackend] = getattr(importlib.import_module(module), cls)
    return found


def build_backend(cfg: RunConfig) -> TrainingBackend:
    """The backend ``trainer.backend`` names, with the policy loaded (slow: call in a thread)."""
    return backend_class(cfg.trainer.backend).from_config(cfg)


def ranked_backend(cfg: RunConfig, ranks: Ranks) -> TorchBackend:
    """The backend ``trainer.backend`` names as one rank of a trainer of many (both backends
    run on many ranks: FSDP2, or Megatron's tensor, expert and data parallelism)."""
    from services.trainer.backends.torch_backend import TorchBackend

    cls = backend_class(cfg.trainer.backend)
    if not issubclass(cls, TorchBackend):
        raise ConfigError(f"trainer.backend {cfg.trainer.backend!r} does not run on many ranks")
    return cls.from_config(cfg, ranks)

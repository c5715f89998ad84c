"""Training backends, chosen by ``trainer.backend`` from a registry behind the `TrainingBackend`
protocol (`base`), as generator engines are chosen by ``policy.generation.backend``:

* ``torch``: a transformers causal LM in plain torch (CPU, or one GPU);
* ``megatron``: megatron-core's GPTModel with its DistributedDataParallel (GPUs, the ``megatron``
  extra), built from a Qwen2/Qwen3 Hugging Face checkpoint.

Each entry is imported only when chosen (torch and megatron-core are heavy).
"""

from __future__ import annotations

import importlib

from services.trainer.backends.base import TrainingBackend
from shared.config_error import ConfigError
from shared.run_config import RunConfig

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

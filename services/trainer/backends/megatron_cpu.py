"""megatron-core on a machine without CUDA: what the megatron backend sets up so that the same
model, DDP and training code run on CPU ranks (gloo), where CI runs them.

megatron-core assumes a GPU in a few places that no setting reaches (checked with 0.16; 0.19
still has them):

* ``torch.cuda.current_device()`` is called unconditionally for the device of new tensors (the
  rotary table on the first forward, attention buffers, tensor-parallel communication buffers,
  DDP's gradient buffers). Without CUDA it is made to answer the CPU device: every such tensor
  lands where the model is.
* The RNG tracker: attention always forks the model-parallel CUDA RNG state
  (``get_cuda_rng_tracker().fork()``), and seeding it (``model_parallel_cuda_manual_seed``) needs
  CUDA. Without CUDA the tracker is megatron's inference tracker, whose fork does nothing: the
  backend trains without dropout (Qwen's attention and hidden dropout are 0), so no stream is lost.
  On GPUs the tracker is seeded per model-parallel rank as megatron expects.
* The default causal mask is built on ``"cuda"``: on CPU the backend passes the mask itself
  (`causal_mask`).

Everything else (fused kernels, Transformer Engine, apex) is off by configuration already (the
local layer spec, no fusions). Called by `services.trainer.backends.megatron_backend`.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_on_cpu = False


def prepare(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker; without CUDA, first let megatron run on CPU."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    global _on_cpu
    if not _on_cpu:
        torch.cuda.current_device = _cpu_device
        _on_cpu = True
        log.info("megatron-core on CPU: CUDA device lookups answer the CPU, RNG tracker without forks")
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def causal_mask(length: int, device: torch.device) -> torch.Tensor | None:
    """The attention mask megatron's attention takes on CPU ([1, 1, T, T], True where a position
    may not attend); None on GPUs, where megatron builds its default causal mask itself."""
    if device.type != "cpu":
        return None
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]

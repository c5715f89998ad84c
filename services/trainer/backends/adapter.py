"""The model-adapter contract: what the training backend (`services.trainer.backends.backend`)
needs from an engine family, and nothing else.

A backend is one step runner composed with one adapter (as a torchtitan TrainSpec composes a
model's functions with one trainer). The adapter owns everything that depends on how the model is
built and split over ranks: building the policy (and, the same way, the frozen reference), the
forward pass to logits, the logprobs of those logits, the schedule that runs a list of
micro-batches through the model (a plain loop, or megatron-core's pipeline schedule), the
backward pass, gradient clipping by the global norm, the optimizer, the checkpoint state and the
weights in Hugging Face layout. The backend owns the step: micro-batches, losses, masking,
normalisation, metrics, the learning-rate schedule and the checkpoint folder.

Implementations, chosen by ``trainer.backend`` (registry: `services.trainer.backends`):
``torch`` = `hf_adapter.HFAdapter` (a transformers causal LM, FSDP2 over many ranks) and
``megatron`` = `megatron_adapter.MegatronAdapter` (megatron-core's GPTModel with tensor, pipeline,
expert and data parallelism). The contract test (tests/integration/test_backend_contract.py)
runs every one that runs on this machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from services.trainer.backends.layout import Layout
from services.trainer.backends.micro_batch import MicroBatch

# A micro-batch's logits -> the loss to backpropagate: (index in the list, inputs, logits).
# On a pipeline only the last stage calls it; a forward-only run ignores what it returns.
OnLogits = Callable[[int, MicroBatch, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LoadedModel:
    """A model the adapter built, and the bytes of the checkpoint this rank read to fill it
    (None when it read the checkpoint whole)."""

    module: torch.nn.Module
    bytes_read: int | None = None


class ModelAdapter(Protocol):
    name: str  # the ``trainer.backend`` value
    layout: Layout
    dtype: torch.dtype  # compute and publish precision (``policy.precision``); master weights float32

    def build(self) -> LoadedModel:
        """A fresh policy loaded from ``policy.model_name``, split over the layout's ranks, in
        training mode (called again for the frozen reference model)."""
        ...

    def pad_token_id(self, model: torch.nn.Module) -> int:
        """The id right-padding is made of (padding is never attended to or scored)."""
        ...

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW over ``model``'s parameters with ``policy.optimizer``'s settings."""
        ...

    def logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's forward pass (a pack as one sequence): [B, T, V] logits, possibly
        this rank's vocabulary columns only (`logprobs` knows); on a stage before the last its
        output activations."""
        ...

    def logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, untruncated: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Each token's logprob under the distribution the generator sampled from, [rows, T]
        (`micro_batch.sampled_logprobs_of`); with top_p < 1 ``untruncated`` receives them under
        the temperature-only softmax."""
        ...

    def run(self, model: torch.nn.Module, mbs: list[MicroBatch], on_logits: OnLogits, *, forward_only: bool) -> None:
        """Every micro-batch through ``model``: logits, ``on_logits``, and unless ``forward_only``
        the backward pass of what it returns (`step.in_order`, or a pipeline schedule)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def zero_grads(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None: ...

    def grads_ready(self, model: torch.nn.Module) -> None:
        """Called after an update's last backward pass, before normalising and clipping."""
        ...

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` by their global norm (the same on every rank); that
        norm. A NaN or inf norm leaves the gradients as they are."""
        ...

    def checkpoint_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool = False
    ) -> dict[str, Any]:
        """Model and optimizer state as a Distributed Checkpoint state dict, in a layout that any
        world size reads back; ``copy``: detached from the live tensors (an asynchronous write)."""
        ...

    def restore_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Put a `checkpoint_state` that a load filled back into ``model`` and ``optimizer``."""
        ...

    def weight_metadata(self, model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor `weight_tensors` gives (HF name, global shape), in its order, on every rank
        (the first call may be collective)."""
        ...

    def weight_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors in HF naming, whole, one at a time (collective: every rank drains
        it), on rank 0 at least."""
        ...

    def save_weights(self, model: torch.nn.Module, out_dir: Path, max_file_bytes: int) -> dict[str, str]:
        """The policy as a safetensors folder generators load, written by every rank; the files'
        digests (every rank's on rank 0)."""
        ...

    def weight_shards(self, model: torch.nn.Module) -> Any:
        """This rank's shard of the policy as a resharding refit reads it (holdings of every rank,
        this rank's boxes: `services.trainer.reshard_source.FsdpShards`); raises
        NotImplementedError where the layout has none built."""
        ...

"""The training-backend contract: what the learner needs from a backend, whatever engine runs it.

A backend owns the policy model, its optimizer and its learning-rate schedule on this process. It
is built from the run config (`from_config`), trains on one step's batch at a time (`train_step`:
one or more optimizer updates, returning typed `LearnerMetrics`), writes the policy as a
safetensors folder that generators load and returns its files' digests (`save_weights`), streams
it tensor by tensor for a collective refit (`weight_metadata`, `weight_tensors`), and
saves and restores everything training needs to resume (`save_checkpoint` / `load_checkpoint`,
into a folder of its own inside the step's checkpoint). Implementations:
`torch_backend.TorchBackend`, `megatron_backend.MegatronBackend`; the registry in
`services.trainer.backends` picks one by ``trainer.backend``. The contract test
(tests/integration/test_backend_contract.py) runs every backend that can run on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, Self

import torch

from services.trainer.batch import StepBatch
from shared.records import LearnerMetrics
from shared.run_config import RunConfig


class TrainingBackend(Protocol):
    name: str

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        """Build the backend and load the policy ``cfg.policy.model_name`` (slow: call in a thread)."""
        ...

    def train_step(self, batch: StepBatch) -> LearnerMetrics:
        """One training step on the batch (one or more optimizer updates)."""
        ...

    def save_weights(self, out_dir: Path) -> dict[str, str]:
        """Write the current policy as a safetensors folder generators can load; the digests of the
        files written (file name -> `shared.weights_format` digest), every file's on rank 0 (on
        other ranks, possibly only their own)."""
        ...

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
        """The tensors `weight_tensors` gives, in Hugging Face naming: (name, shape), in order
        (the first call may be collective: every rank makes it)."""
        ...

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors whole, one at a time, in `weight_metadata`'s order, on rank 0 at
        least (what a collective refit sends; collective: every rank drains it)."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, schedule and RNG state into the existing folder ``path``."""
        ...

    def wait_for_save(self) -> None:
        """Block until the last `save_checkpoint` is on disk (it may write in the background)."""
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote into ``path``."""
        ...

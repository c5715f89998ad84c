"""The training-backend contract the trainer loop relies on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from services.trainer.batch import StepBatch


class TrainingBackend(Protocol):
    def train_step(self, batch: StepBatch) -> dict[str, float]:
        """One training step on the batch (one or more optimizer updates); returns metrics."""

    def save_weights(self, out_dir: Path) -> None:
        """Write the current policy weights as a safetensors folder generators can load."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume training (model, optimizer, RNG)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

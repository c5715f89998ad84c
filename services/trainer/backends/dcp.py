"""A backend's part of a step's checkpoint folder: the model and optimizer state as a torch
Distributed Checkpoint (``shards/``: every rank writes its part, any world size reads it back,
in the layout the model adapter gives), and the schedule, update count and RNG from rank 0
(``trainer_state.pt``). With ``checkpointing.async_save`` a save returns once the shards are
staged in memory and `LearnerCheckpoint.wait` returns once they are on disk. Used by
`services.trainer.backends.backend.Backend`.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from services.trainer.ranks import Ranks

TRAINER_STATE = "trainer_state.pt"
SHARDS = "shards"


class LearnerCheckpoint:
    def __init__(self, ranks: Ranks, *, async_save: bool) -> None:
        self.ranks = ranks
        self.async_save = async_save
        self._pending: Future[Any] | Any | None = None  # the last asynchronous write

    def save(self, state: dict[str, Any], trainer_state: dict[str, Any], path: Path) -> None:
        """Write ``state`` (a Distributed Checkpoint state dict) and, on rank 0, ``trainer_state``
        into the existing folder ``path``, after the last asynchronous write is on disk."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        if self.ranks.is_root:
            torch.save(trainer_state, path / TRAINER_STATE)
        where = str(path / SHARDS)
        if self.async_save:
            group = self.ranks.checkpoint_group
            self._pending = dcp.async_save(state, checkpoint_id=where, process_group=group, no_dist=group is None)
        else:
            dcp.save(state, checkpoint_id=where, no_dist=not self.ranks.sharded)

    def wait(self) -> None:
        """Block until the last asynchronous write is on disk (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            getattr(pending, "upload_completion", pending).result()

    def load(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Fill ``state`` in place from ``path``'s shards; the trainer state saved beside them."""
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(path / SHARDS), no_dist=not self.ranks.sharded)
        extra: dict[str, Any] = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
        return extra

"""The training-backend contract: what the learner needs from a backend, whatever engine runs it.

A backend owns the policy model, its optimizer and its learning-rate schedule on this process,
as one rank of the trainer (`layout`: its place among the ranks, computed before the model was
built). It splits a step's batch into each data rank's share (`plan`, on the rank that drives),
trains this rank's share with every other rank at once (`train_share`: one or more optimizer
updates, returning the step's global `LearnerMetrics`; `train_step` is the one-rank step), writes
the policy as a safetensors folder that generators load and returns its files' digests
(`save_weights`), streams it tensor by tensor in ``dtype`` for a collective refit
(`weight_metadata`, `weight_tensors`), and saves and restores everything training needs to resume
(`save_checkpoint` / `load_checkpoint`, into a folder of its own inside the step's checkpoint).

The learners depend on this Protocol only: `services.trainer.learner.LocalLearner` (one
process), `services.trainer.rank_learner.RankedLearner` and `follow` (many ranks), and the
collective sender (`services.trainer.weight_send`). The implementation is
`services.trainer.backends.backend.Backend`, one step runner composed with a model adapter
(`adapter.ModelAdapter`) that ``trainer.backend`` picks from the registry in
`services.trainer.backends`. The contract test (tests/integration/test_backend_contract.py) runs
every adapter that can run on this machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from services.trainer.backends.layout import Layout
from services.trainer.batch import StepBatch
from services.trainer.step_plan import RankShare
from shared.records import LearnerMetrics


class NonFiniteGradient(FloatingPointError):
    """An optimizer update's gradient norm was NaN or inf while ``policy.on_nonfinite_grad`` is
    ``fail``: the update was not applied. The message names the parameters whose gradients hold
    such values on the rank that raised (the control plane adds the step)."""


def nonfinite_grads(grads: Iterable[tuple[str, torch.Tensor | None]]) -> list[str]:
    """The names of ``(name, gradient)`` pairs whose gradient (a DTensor's local shard) holds a
    NaN or an inf, in order."""
    from torch.distributed.tensor import DTensor

    names = []
    for name, g in grads:
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if not bool(torch.isfinite(local).all()):
            names.append(name)
    return names


def describe_nonfinite(names: list[str], rank: int, shown: int = 3) -> str:
    """Which parameters hold the non-finite gradients, for an error or a warning."""
    if not names:
        return f"no parameter's gradient on rank {rank} holds one (another rank's does)"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"non-finite gradients on rank {rank} in {', '.join(names[:shown])}{more}"


class TrainingBackend(Protocol):
    @property
    def name(self) -> str:
        """The ``trainer.backend`` value."""
        ...

    @property
    def layout(self) -> Layout: ...

    @property
    def dtype(self) -> torch.dtype:
        """The precision the policy computes in and is published in."""
        ...

    def plan(self, batch: StepBatch) -> list[RankShare]:
        """Each data rank's share of the step (`Layout.data`), empty when nothing is trainable."""
        ...

    def train_share(self, share: RankShare | None) -> LearnerMetrics:
        """This rank's share of a step, with every other rank at once (None: nothing trainable,
        on every rank); the step's global metrics."""
        ...

    def train_step(self, batch: StepBatch) -> LearnerMetrics:
        """One step on the whole batch, on a trainer of one rank."""
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

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Each token's logprob given those before it, from the raw logits (a refit's probe);
        collective: every rank calls it."""
        ...

    def weight_shards(self) -> Any:
        """This rank's own shard as a resharding refit reads it (`ModelAdapter.weight_shards`)."""
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

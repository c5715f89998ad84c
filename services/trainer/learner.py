"""The learner: the part of the trainer that runs the training backend.

The trainer is two roles. The control plane (`services.trainer.control_plane`) owns Redis, the
REST API, the scheduler, the replay buffer, validation, refit coordination and the metrics
records. The learner owns the model: forward, backward and optimizer, its part of each checkpoint,
and the export of the weights. Between them, this narrow interface:

    control plane --StepBatch--------------> Learner.train ----> LearnerMetrics
                  --export_weights(folder)--> a safetensors folder generators load, and its manifest
                                              (file name -> digest; called by the refit)
                  --send_weights(order)-----> the policy straight into the generators' engines
                                              (a collective refit, `services.trainer.weight_send`)
                  --save(folder) / load(folder)--> the learner's part of a step's checkpoint
                  --wait_saved()-------------> returns once that part is on disk (asynchronous saves)

`LocalLearner` runs the backend in this process, in a worker thread, so the control plane's event
loop keeps serving REST and streams while a step trains. `services.trainer.rank_learner.RankedLearner`
keeps this interface over many ranks: rank 0 hands each step's batch to the others and returns
their reduced metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.trainer.backends.base import TrainingBackend
from services.trainer.batch import StepBatch
from services.trainer.weight_send import CollectiveSender, ReshardSent, SendOrder, weight_source
from shared.records import LearnerMetrics

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

log = logging.getLogger(__name__)


class LearnerLost(RuntimeError):
    """The learner's processes were lost (a rank died or stopped answering). The trainer fails
    (exit code 1), but the run stays open for its workers: a restart resumes from the newest
    checkpoint, as after a crash of the trainer itself."""


class Learner(Protocol):
    @property
    def backend(self) -> TrainingBackend:
        """The training backend (rank 0's, in a trainer of many ranks); after `start`."""
        ...

    async def start(self) -> None:
        """Build the backend and load the policy."""
        ...

    async def train(self, batch: StepBatch) -> LearnerMetrics:
        """One step on ``batch``; its metrics."""
        ...

    def export_weights(self, out_dir: Path) -> dict[str, str]:
        """Write the policy as a safetensors folder (called from the refit's writer thread); the
        manifest of every file written (file name -> digest, `shared.weights_format`)."""
        ...

    def send_weights(self, order: SendOrder, client: VLLMWeightSyncClient) -> str | ReshardSent | None:
        """Send the policy over the transfer group ``order`` names (called from the refit's thread;
        ``client`` reaches the generators); the checksum of what was sent, when known."""
        ...

    async def probe(self, token_ids: list[int]) -> list[float]:
        """The policy's raw logprobs of ``token_ids`` (`TrainingBackend.probe_logprobs`)."""
        ...

    async def save(self, path: Path) -> None:
        """Write the learner's part of a checkpoint into the existing folder ``path``."""
        ...

    async def wait_saved(self) -> None:
        """Return once the last `save` is on disk (at once when saves are synchronous)."""
        ...

    async def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        ...

    async def watch(self) -> None:
        """Run for as long as the learner lives (the service supervises it); raise when the learner
        is lost (a rank died or stopped answering)."""
        ...

    async def close(self) -> None:
        """Release the learner (other ranks stop)."""
        ...


class LocalLearner:
    """The learner of a single-process trainer: ``build()`` makes the backend (in a thread, at
    `start`), and every call on it runs in a worker thread."""

    def __init__(self, build: Callable[[], TrainingBackend]) -> None:
        self._build = build
        self._backend: TrainingBackend | None = None
        self._sender: CollectiveSender | None = None
        # Training and the refit's probe run on one thread of their own: a forward on a fresh
        # thread of the default executor touches a fresh malloc arena (tens of MiB of resident
        # memory, seen as a late jump in the soak test's trainer RSS).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")

    @property
    def backend(self) -> TrainingBackend:
        if self._backend is None:
            raise RuntimeError("the learner has not started: call start() first")
        return self._backend

    async def start(self) -> None:
        self._backend = await asyncio.to_thread(self._build)

    async def train(self, batch: StepBatch) -> LearnerMetrics:
        return await asyncio.get_running_loop().run_in_executor(self._compute, self.backend.train_step, batch)

    def export_weights(self, out_dir: Path) -> dict[str, str]:
        return self.backend.save_weights(out_dir)

    def send_weights(self, order: SendOrder, client: VLLMWeightSyncClient) -> str | ReshardSent | None:
        if self._sender is None:
            self._sender = sender_of(self.backend, rank=0)
        return self._sender.send(order, client)

    async def probe(self, token_ids: list[int]) -> list[float]:
        return await asyncio.get_running_loop().run_in_executor(self._compute, self.backend.probe_logprobs, token_ids)

    async def save(self, path: Path) -> None:
        await asyncio.to_thread(self.backend.save_checkpoint, path)

    async def wait_saved(self) -> None:
        await asyncio.to_thread(self.backend.wait_for_save)

    async def load(self, path: Path) -> None:
        await asyncio.to_thread(self.backend.load_checkpoint, path)

    async def watch(self) -> None:
        await asyncio.Event().wait()  # nothing to lose: the backend runs in this process

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._compute.shutdown(wait=False)


def sender_of(backend: TrainingBackend, rank: int) -> CollectiveSender:
    """The collective sender over ``backend``'s weight stream (`TrainingBackend.weight_tensors`),
    in its compute precision. Every rank makes it at once (the backend's metadata may be
    gathered)."""
    return CollectiveSender(weight_source(backend, backend.dtype), rank, shards=backend.weight_shards)

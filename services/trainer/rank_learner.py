"""The learner over many ranks: rank 0 drives, every other rank follows.

Rank 0 runs the control plane with a `RankedLearner`; each other rank runs `follow`, which waits
for rank 0's commands and runs its part of each. One command at a time, over the trainer's process
group (a broadcast of the command, then what it carries)::

    rank 0 (RankedLearner)                        ranks 1..N-1 (follow)
    train(batch):   TRAIN  + scatter(shares)  ->  backend.train_share(share)      (FSDP collectives)
    export_weights: EXPORT(folder)            ->  backend.save_weights(folder)   (tensor by tensor;
                                                  each rank writes its share of the files)
    send_weights:   SEND(order)               ->  its part of the FSDP gathers while rank 0 sends
    save / load:    SAVE / LOAD(folder)       ->  backend.save_checkpoint / load_checkpoint
    wait_saved:     WAIT_SAVED                ->  backend.wait_for_save
    (idle)          PING every collective_timeout_s / 4
    close:          STOP                      ->  return

Every collective is bounded by ``trainer.collective_timeout_s``: a follower waiting for its next
command gets a PING well within it while rank 0 waits for data, so silence means rank 0 is gone
or stuck, and the follower fails. When a follower dies, rank 0's next command (at the latest the
next PING) fails, `watch` raises, and the trainer fails with exit code 1; torchrun then stops every
rank, and the restart resumes from the newest checkpoint. A command that fails on a follower ends
that follower with exit code 1 (its partners' collectives then fail, or time out).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from services.trainer.batch import StepBatch
from services.trainer.learner import LearnerLost, sender_of
from services.trainer.ranks import Ranks, lost_hosts
from services.trainer.weight_send import CollectiveSender, ReshardSent, SendOrder
from shared.records import LearnerMetrics
from shared_torch.weight_wire import TransferError

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    from services.trainer.backends.base import TrainingBackend
    from services.trainer.step_plan import RankShare

log = logging.getLogger(__name__)

T = TypeVar("T")


class Op(StrEnum):
    TRAIN = "train"
    EXPORT = "export"
    SEND = "send"
    PROBE = "probe"
    SAVE = "save"
    WAIT_SAVED = "wait_saved"
    LOAD = "load"
    PING = "ping"
    STOP = "stop"


@dataclass(frozen=True)
class Command:
    op: Op
    path: str | None = None
    order: SendOrder | None = None
    tokens: list[int] | None = None


def _broadcast(command: Command | None) -> Command:
    box: list[Any] = [command]
    dist.broadcast_object_list(box, src=0)
    found: Command = box[0]
    return found


def _scatter(shares: list[RankShare | None] | None) -> RankShare | None:
    out: list[Any] = [None]
    dist.scatter_object_list(out, shares, src=0)
    share: RankShare | None = out[0]
    return share


class RankLost(LearnerLost):
    """The trainer's other ranks stopped answering (one died, hangs, or its command failed)."""


class RankedLearner:
    """The learner of rank 0 in a trainer of many ranks (see the module docstring)."""

    def __init__(self, build: Callable[[], TrainingBackend], ranks: Ranks, *, collective_timeout_s: float) -> None:
        self._build = build
        self.ranks = ranks
        self.keepalive_s = collective_timeout_s / 4
        self._backend: TrainingBackend | None = None
        self._sender: CollectiveSender | None = None
        self._lock = threading.Lock()  # one command at a time, whichever thread sends it
        self._last_command = time.monotonic()
        self._closed = False

    @property
    def backend(self) -> TrainingBackend:
        if self._backend is None:
            raise RuntimeError("the learner has not started: call start() first")
        return self._backend

    async def start(self) -> None:
        self._backend = await asyncio.to_thread(self._build)
        self._last_command = time.monotonic()

    def _command(self, command: Command, run: Callable[[], T]) -> T:
        with self._lock:
            if self._closed:
                raise RankLost("the learner is closed")
            try:
                _broadcast(command)
                return run()
            except TransferError:
                raise  # the generators' transfer group failed, not the trainer's ranks
            except Exception as exc:
                if isinstance(exc, (RuntimeError, dist.DistBackendError)) and _is_comm_error(exc):
                    raise RankLost(
                        f"trainer ranks lost during {command.op} ({lost_hosts(self.ranks, exc)}): {exc}"
                    ) from exc
                raise
            finally:
                self._last_command = time.monotonic()

    async def train(self, batch: StepBatch) -> LearnerMetrics:
        def run() -> LearnerMetrics:
            backend = self.backend
            shares = backend.plan(batch)
            # each rank gets its data rank's share (tensor-parallel and pipeline peers the same one)
            of_rank = backend.layout.data_rank_of
            mine = _scatter([shares[d] for d in of_rank] if shares else [None] * self.ranks.world_size)
            return backend.train_share(mine)

        return await asyncio.to_thread(self._command, Command(Op.TRAIN), run)

    def export_weights(self, out_dir: Path) -> dict[str, str]:
        """Every rank writes its share of the folder; the manifest of every rank's files."""
        return self._command(Command(Op.EXPORT, str(out_dir)), lambda: self.backend.save_weights(out_dir))

    def send_weights(self, order: SendOrder, client: VLLMWeightSyncClient) -> str | ReshardSent | None:
        def run() -> str | ReshardSent | None:
            if self._sender is None:
                self._sender = sender_of(self.backend, rank=0)
            return self._sender.send(order, client)

        return self._command(Command(Op.SEND, order=order), run)

    async def probe(self, token_ids: list[int]) -> list[float]:
        command = Command(Op.PROBE, tokens=list(token_ids))
        return await asyncio.to_thread(self._command, command, lambda: self.backend.probe_logprobs(token_ids))

    async def save(self, path: Path) -> None:
        await asyncio.to_thread(self._command, Command(Op.SAVE, str(path)), lambda: self.backend.save_checkpoint(path))

    async def wait_saved(self) -> None:
        await asyncio.to_thread(self._command, Command(Op.WAIT_SAVED), self.backend.wait_for_save)

    async def load(self, path: Path) -> None:
        await asyncio.to_thread(self._command, Command(Op.LOAD, str(path)), lambda: self.backend.load_checkpoint(path))

    async def watch(self) -> None:
        """PING the followers whenever no command went out for ``keepalive_s``; raises `RankLost`.
        Starts once the backend is built: the followers build theirs before taking commands."""
        while self._backend is None:
            await asyncio.sleep(0.1)
        while not self._closed:
            await asyncio.sleep(max(0.05, self._last_command + self.keepalive_s - time.monotonic()))
            if not self._closed and time.monotonic() - self._last_command >= self.keepalive_s:
                await asyncio.to_thread(self._command, Command(Op.PING), lambda: None)

    async def close(self) -> None:
        def stop() -> None:
            self._command(Command(Op.STOP), lambda: None)
            self._closed = True

        if not self._closed and self._backend is not None:
            await asyncio.to_thread(stop)


def _is_comm_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, dist.DistBackendError) or any(
        s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "peer")
    )


def follow(backend: TrainingBackend) -> None:
    """A follower rank's life: run rank 0's commands until STOP (raises when one fails)."""
    ranks = backend.layout.world
    sender: CollectiveSender | None = None
    while True:
        command = _broadcast(None)
        if command.op == Op.STOP:
            log.info("rank %d: stopped by rank 0", ranks.rank)
            return
        path = Path(command.path) if command.path is not None else None
        match command.op:
            case Op.TRAIN:
                backend.train_share(_scatter(None))
            case Op.EXPORT:
                assert path is not None
                backend.save_weights(path)
            case Op.SEND:
                assert command.order is not None
                sender = sender or sender_of(backend, rank=ranks.rank)
                try:
                    sender.send(command.order, None)
                except TransferError as exc:  # the generators' group failed: rank 0 reports it, names it
                    log.warning("rank %d: weight transfer failed: %s", ranks.rank, exc)
            case Op.PROBE:
                assert command.tokens is not None
                backend.probe_logprobs(command.tokens)
            case Op.SAVE:
                assert path is not None
                backend.save_checkpoint(path)
            case Op.WAIT_SAVED:
                backend.wait_for_save()
            case Op.LOAD:
                assert path is not None
                backend.load_checkpoint(path)
            case Op.PING:
                pass

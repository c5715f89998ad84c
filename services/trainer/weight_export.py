"""Publishing the policy from sharded parameters, one tensor at a time, every rank writing a share.

A learner's parameters may be sharded over many ranks (FSDP2 DTensors). `full_tensors` walks the
model's state dict in one fixed order and gathers each tensor whole (an all-gather every rank
joins), so no rank ever holds more than one tensor beyond its own shard on its device. After each
gather every rank holds the whole tensor, so the writing is shared out: `rank_tensors` deals each
tensor to the rank with the fewest bytes so far (`Dealer`: computed from the sizes alone, so every
rank deals the same hands without a word) and keeps only this rank's. Each rank feeds its share to
a `ShardWriter`, which writes safetensors files of at most ``max_shard_bytes`` in a background
thread while the gathers go on, hashing each file's bytes as it writes them (in host memory: the
file filling, the image of the one being written, and for a moment that file's tensors too). Then
the ranks agree on the files' Hugging Face names (rank 0's files first), each renames its own and
returns their digests, and rank 0 writes the index naming every rank's files. The folder is what
generators load (`shared.weights_format`); every rank must see it (checkpoint folders already need
a shared filesystem).

    full_tensors (every rank) -> Dealer -> this rank's tensors -> ShardWriter -> .part files
    close(): all-gather the part lists -> rename to model-0000k-of-0000n -> all-gather the digests

`full_tensors`'s stream of (name, tensor) pairs is the learner's weight-export interface: a
transport that moves tensors instead of files consumes the same iterator.

Files are at most 512 MiB by default: the writer thread writes one while the next fills (the cast
of the next tensors overlaps the write of the last file), and a generator verifies the files'
digests in parallel, one thread per file. With one file of 2 GiB neither overlapped. While the
weights are cast for the export the learner is idle, so `refit_threads` lends the cast every core
this rank may use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from services.trainer.ranks import SINGLE, Ranks
from shared.weights_format import write_safetensors

DEFAULT_MAX_SHARD_BYTES = 512 << 20
INDEX_NAME = "model.safetensors.index.json"


def refit_cores() -> int:
    """The cores one rank may use while it publishes: those this process may run on, shared by
    the ranks of its node (``LOCAL_WORLD_SIZE``, set by torchrun)."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


@contextmanager
def refit_threads() -> Iterator[None]:
    """Run the block with torch's intra-op threads raised to `refit_cores` (never lowered),
    then put the count back. The export casts float32 master weights to bfloat16 into fresh
    memory, which one thread does at about 1.4 GiB/s of output (page faults dominate; a second
    core nearly doubles it); the learner is idle while it publishes, so the training's thread
    count (``trainer.torch_threads``) need not bound it. Set and restored in the calling thread,
    which is the one that casts."""
    before = torch.get_num_threads()
    wanted = refit_cores()
    if wanted > before:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        if wanted > before:
            torch.set_num_threads(before)


def gathered(model: torch.nn.Module, skip: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state-dict tensor of ``model`` (but ``skip``), whole, where and as it is (collective
    when the model is sharded: every rank must drain the iterator)."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if name not in skip:
            yield name, t.full_tensor() if isinstance(t, DTensor) else t


def as_published(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as it is published: ``dtype``, on the CPU, contiguous."""
    return t.detach().to(dtype=dtype, device="cpu").contiguous()


def full_tensors(
    model: torch.nn.Module, dtype: torch.dtype, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state-dict tensor of ``model`` (but ``skip``), whole, as ``dtype``, on the CPU.
    Collective when the model is sharded: every rank must drain the iterator."""
    for name, whole in gathered(model, skip):
        yield name, as_published(whole, dtype)


class Dealer:
    """Deals tensors to ``world_size`` ranks in the order they come, each to the rank holding the
    fewest bytes so far (the lowest such rank on a tie)."""

    def __init__(self, world_size: int) -> None:
        self.loads = [0] * world_size

    def owner(self, num_bytes: int) -> int:
        rank = min(range(len(self.loads)), key=self.loads.__getitem__)
        self.loads[rank] += num_bytes
        return rank


def rank_tensors(
    model: torch.nn.Module, dtype: torch.dtype, ranks: Ranks, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's deal of `full_tensors` (only its tensors are copied to the CPU). Collective
    like `full_tensors`: every rank must drain the iterator."""
    return deal(gathered(model, skip), dtype, ranks)


def deal(
    tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, ranks: Ranks
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's deal of a stream of whole tensors that every rank walks in the same order (only
    its tensors are copied to the CPU, as ``dtype``)."""
    dealer = Dealer(ranks.world_size)
    item_bytes = torch.empty((), dtype=dtype).element_size()
    for name, whole in tensors:
        if dealer.owner(whole.numel() * item_bytes) == ranks.rank:
            yield name, as_published(whole, dtype)


@dataclass(frozen=True)
class _Part:
    """A file this rank wrote under its temporary name."""

    path: Path
    names: list[str]
    num_bytes: int
    digest: str


class ShardWriter:
    """Writes one rank's tensors into files of at most ``max_shard_bytes`` as they come (in a
    background thread: at most one file is being written while the next fills), then names every
    rank's files as Hugging Face does (``model.safetensors`` alone, or ``model-0000k-of-0000n``
    with an index). Every rank of ``ranks`` builds one and calls `close` (a collective)."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, *, ranks: Ranks = SINGLE) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.ranks = ranks
        self.manifest: dict[str, str] = {}  # set by `close`: final file name -> digest
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[_Part] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-writer")
        self._writing: Future[_Part] | None = None
        self.total_bytes = 0  # of this rank's tensors

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def close(self) -> list[Path]:
        """Write what is left and give every rank's files their final names; this rank's files,
        in order. Sets `manifest`: this rank's files' digests, and on rank 0 every rank's."""
        try:
            self._flush()
            self._wait()
        finally:
            self._pool.shutdown()
        plans: list[list[tuple[list[str], int]]] = self.ranks.gather([(p.names, p.num_bytes) for p in self._parts])
        n = sum(len(plan) for plan in plans)
        if n == 0:
            raise ValueError("no tensor was written")
        first = 1 + sum(len(plan) for plan in plans[: self.ranks.rank])
        final: list[Path] = []
        for i, part in enumerate(self._parts, start=first):
            path = self.out_dir / _file_name(i, n)
            part.path.rename(path)
            final.append(path)
            self.manifest[path.name] = part.digest
        # Also a barrier: once rank 0 returns, every rank's files have their final names.
        manifests: list[dict[str, str]] = self.ranks.gather(self.manifest)
        if self.ranks.is_root:
            self.manifest = {name: d for m in manifests for name, d in m.items()}
            if n > 1:
                self._write_index(plans, n)
        return final

    def _write_index(self, plans: list[list[tuple[list[str], int]]], n: int) -> None:
        parts = [part for plan in plans for part in plan]
        weight_map = {name: _file_name(i, n) for i, (names, _) in enumerate(parts, start=1) for name in names}
        index = {"metadata": {"total_size": sum(b for _, b in parts)}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))

    def _flush(self) -> None:
        if not self._pending:
            return
        self._wait()  # one file in flight at a time bounds the memory
        path = self.out_dir / f".part-{self.ranks.rank:05d}-{len(self._parts) + 1:05d}.safetensors"
        tensors, num_bytes = self._pending, self._pending_bytes
        self._pending, self._pending_bytes = {}, 0
        self._writing = self._pool.submit(_write_part, path, tensors, num_bytes)

    def _wait(self) -> None:
        if self._writing is not None:
            writing, self._writing = self._writing, None
            self._parts.append(writing.result())


def _write_part(path: Path, tensors: dict[str, torch.Tensor], num_bytes: int) -> _Part:
    names = list(tensors)
    digest = write_safetensors(path, tensors, metadata={"format": "pt"}, consume=True)
    return _Part(path, names, num_bytes, digest)


def _file_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"

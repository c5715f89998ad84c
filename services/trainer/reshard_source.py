"""What a trainer rank sends in a refit without a gather: the published boxes the plan gives it,
read straight out of its own shard.

`FsdpShards` is the torch backend's side: FSDP2 keeps each parameter's rows ``torch.chunk``-ed
over the ranks (one rank: the whole parameter), and the published (stored) tensors come from the
parameters through transformers' reverse conversion (`shared_torch.stored_names.as_stored`:
identity for most, experts split out of fused parameters). Running that conversion once on each
parameter's element indices says, for every element of a published tensor, which parameter
element it is; a box of it is then a strided view of one rank's local shard (`strided`), or, where
no single stride pattern fits, a gather of the elements. Both are worked out once per transfer
group, so a refit only copies (and casts) each box into a send buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.trainer.reshard_plan import Holdings, fsdp_holdings
from shared.boxes import Box
from shared_torch.reshard_wire import Piece, slices


def strided(index: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    """(offset, strides) with ``index[i] == offset + sum(i_k * strides[k])`` for every element of
    the integer array ``index``, or None when no such pattern exists."""
    if index.size == 0:
        return None
    offset = int(index.reshape(-1)[0])
    strides = []
    for d, n in enumerate(index.shape):
        if n == 1:
            strides.append(0)
            continue
        step = [0] * index.ndim
        step[d] = 1
        strides.append(int(index[tuple(step)]) - offset)
    grid = offset + sum(
        (np.arange(n, dtype=np.int64) * s).reshape([-1 if k == d else 1 for k in range(index.ndim)])
        for d, (n, s) in enumerate(zip(index.shape, strides, strict=True))
    )
    if not np.array_equal(np.broadcast_to(grid, index.shape), index):
        return None
    return offset, tuple(strides)


@dataclass(frozen=True)
class Take:
    """Where (part of) a box's values lie in one local tensor ``key``: a strided view of it, or
    a gather of its elements; with ``mask``, the box positions they fill (the rest come from
    other local tensors)."""

    key: str
    shape: tuple[int, ...]
    offset: int = 0
    strides: tuple[int, ...] = ()
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def read(self, local: torch.Tensor) -> torch.Tensor:
        flat = local.reshape(-1)
        if self.index is not None:
            return flat[self.index]
        return flat.as_strided(self.shape, self.strides, flat.storage_offset() + self.offset)

    def put(self, local: torch.Tensor, out: torch.Tensor) -> None:
        """Write this take's values into ``out`` (the box's shape)."""
        if self.mask is not None:
            out[self.mask] = self.read(local).to(out.dtype)
        elif self.index is not None:
            out.copy_(self.read(local).view(self.shape))
        else:
            out.copy_(self.read(local))


def take_of(key: str, index: np.ndarray, mask: np.ndarray | None = None) -> Take:
    """The take of the box positions ``mask`` (all: None or all true) from local tensor ``key``,
    whose flat element ``index[p]`` holds box position ``p``."""
    shape = tuple(index.shape)
    if mask is not None and not mask.all():
        return Take(key, shape, index=torch.from_numpy(index[mask].copy()), mask=torch.from_numpy(mask.copy()))
    found = strided(index)
    if found is None:
        return Take(key, shape, index=torch.from_numpy(index.reshape(-1).copy()))
    return Take(key, shape, found[0], found[1])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach() if local.is_contiguous() else local.detach().contiguous()


class FsdpShards:
    """Rank ``rank`` of ``world_size`` of an FSDP2-sharded (or whole, at one rank) transformers
    ``model``: its holdings for the plan, and the boxes the plan asks of it read from its shard."""

    def __init__(self, model: torch.nn.Module, world_size: int, rank: int, skip: frozenset[str]) -> None:
        from shared_torch.stored_names import as_stored

        self.model = model
        self.world_size = world_size
        self.rank = rank
        self.skip = skip
        # published name -> (parameter, the parameter's flat element index of each element)
        self._origin: dict[str, tuple[str, np.ndarray]] = {}
        self._takes: dict[Piece, Take] = {}
        self._rows: dict[str, tuple[int, int]] = {}  # parameter -> (rows per rank, elements per row)
        for name, t in model.state_dict().items():
            if name in skip:
                continue
            shape = tuple(t.shape)
            row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
            self._rows[name] = (-(-(shape[0] if shape else 1) // world_size), row)
            index = torch.arange(int(np.prod(shape, dtype=np.int64))).view(shape)
            for stored, elements in as_stored(model, [(name, index)]):
                self._origin[stored] = (name, elements.numpy().astype(np.int64))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The published tensors this layout sends, with their shapes."""
        return {name: tuple(elements.shape) for name, (_, elements) in self._origin.items()}

    def holdings(self) -> Holdings:
        """What every rank holds (the plan is made on rank 0 for all)."""

        from shared_torch.stored_names import as_stored

        def published(pairs: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
            return as_stored(self.model, ((n, t) for n, t in pairs if n not in self.skip))

        return fsdp_holdings(self.model, self.world_size, published)

    def _take(self, name: str, box: Box) -> Take:
        param, elements = self._origin[name]
        per_rank, row = self._rows[param]
        return take_of(param, elements[slices(box)] - self.rank * per_rank * row)

    def prepare(self, pieces: Iterable[Piece]) -> None:
        """Work out where each piece this rank sends lies in its shard (once per transfer group)."""
        self._takes = {piece: self._take(*piece) for piece in pieces}

    def reader(self) -> Callable[[Piece, torch.Tensor], None]:
        """``fill(piece, out)`` for `shared_torch.reshard_wire.send_links` over the current
        weights, for the pieces `prepare` was given."""
        takes = self._takes
        state = self.model.state_dict()
        locals_ = {key: _local(state[key]) for key in {t.key for t in takes.values()}}

        def fill(piece: Piece, out: torch.Tensor) -> None:
            take = takes[piece]
            take.put(locals_[take.key], out)

        return fill

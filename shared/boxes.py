"""Boxes: a rectangular slice of one tensor, a ``[start, stop)`` range per dimension.

The refit's resharding plan describes what each trainer rank holds and what each engine rank
needs of every published tensor as lists of boxes, and cuts what it sends from them
(`services.trainer.reshard_plan`). A tensor-parallel part is one box; a rank's heads of a fused
projection are one box per part; a replicated tensor is the whole box (`whole`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]


def whole(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def volume(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None."""
    out = tuple((max(sa, sb), min(ea, eb)) for (sa, ea), (sb, eb) in zip(a, b, strict=True))
    return out if all(s < e for s, e in out) else None


def subtract(a: Box, b: Box) -> list[Box]:
    """Disjoint boxes covering ``a`` outside ``b`` (at most two per dimension)."""
    inner = intersect(a, b)
    if inner is None:
        return [a]
    out = []
    rest = list(a)
    for d, ((s, e), (si, ei)) in enumerate(zip(a, inner, strict=True)):
        if s < si:
            out.append((*rest[:d], (s, si), *rest[d + 1 :]))
        if ei < e:
            out.append((*rest[:d], (ei, e), *rest[d + 1 :]))
        rest[d] = (si, ei)
    return out


def mask_boxes(mask: np.ndarray) -> list[Box]:
    """Disjoint boxes covering the true elements of ``mask`` exactly: runs of equal slices along
    the first dimension, each split into the boxes of its slice."""
    if mask.ndim == 0:
        return [()] if bool(mask) else []
    rows = mask.reshape(mask.shape[0], -1)
    if mask.ndim == 1:
        edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
        return [((int(s), int(e)),) for s, e in zip(edges[::2], edges[1::2], strict=True)]
    change = np.flatnonzero(np.any(rows[1:] != rows[:-1], axis=1)) + 1
    bounds = [0, *change.tolist(), mask.shape[0]]
    out: list[Box] = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if rows[s].any():
            out.extend(((s, e), *sub) for sub in mask_boxes(mask[s]))
    return out


class Numbering:
    """Every element of a set of tensors numbered once: tensor ``name``'s elements are
    ``first[name] + 0 .. numel - 1`` in row-major order, from 1 (0 stays free for padding a
    loader fills in). Code that moves tensors around (a checkpoint conversion, a weight loader)
    run on these numbers instead of weights says which element ended up where: `boxes` turns
    the numbers a rank holds back into boxes of the tensors they came from."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.names = list(shapes)
        sizes = np.array([int(np.prod(shapes[n], dtype=np.int64)) for n in self.names], dtype=np.int64)
        self.starts = np.concatenate([[1], 1 + np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.first = dict(zip(self.names, self.starts.tolist(), strict=True))
        if int(self.starts[-1] + sizes[-1]) >= 2**53:
            raise ValueError("more elements than float64 numbers exactly")

    def numbers(self, name: str) -> np.ndarray:
        """Tensor ``name``'s element numbers (float64, its shape)."""
        shape = self.shapes[name]
        n = int(np.prod(shape, dtype=np.int64))
        return np.arange(self.first[name], self.first[name] + n, dtype=np.float64).reshape(shape)

    def boxes(self, held: np.ndarray) -> dict[str, list[Box]]:
        """The boxes of each tensor whose element numbers are in ``held`` (any shape; values
        below 1 are padding, not elements)."""
        held = np.unique(held[held > 0]).astype(np.int64)  # sorted, so each tensor's are a run
        owner = np.searchsorted(self.starts, held, side="right") - 1
        tensors, firsts = np.unique(owner, return_index=True)
        out: dict[str, list[Box]] = {}
        for i, lo, hi in zip(tensors, firsts, [*firsts[1:], len(held)], strict=True):
            name = self.names[i]
            mask = np.zeros(int(np.prod(self.shapes[name], dtype=np.int64)), dtype=bool)
            mask[held[lo:hi] - self.starts[i]] = True
            out[name] = mask_boxes(mask.reshape(self.shapes[name]))
        return out


def split(box: Box, max_volume: int) -> list[Box]:
    """``box`` cut into row-major consecutive boxes of at most ``max_volume`` elements each: whole
    slabs along the first dimension where a slab fits, a slab cut the same way where it does not."""
    if volume(box) <= max_volume or not box:
        return [box]
    (start, stop), rest = box[0], box[1:]
    slab = volume(rest)
    if slab <= max_volume:
        step = max_volume // slab
        return [((s, min(s + step, stop)), *rest) for s in range(start, stop, step)]
    return [((s, s + 1), *part) for s in range(start, stop) for part in split(rest, max_volume)]

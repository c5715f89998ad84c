"""Sequence packing: rows of different lengths share micro-batches up to a token budget.

Rows are assigned to packs by first-fit decreasing (longest first, each into the first pack with
room; a row longer than the budget gets a pack of its own). A pack is run as one sequence whose
position ids restart at 0 for every row; with no 2D attention mask and no KV cache, transformers
turns restarting position ids into a block-diagonal causal mask, so no row attends to another.
Per-token logprobs are then cut back out per row (each row's first token has none) and laid out
as the unpacked [rows, T] tensors, so the loss is computed exactly as without packing.

``packing_efficiency`` is the share of a pack's token budget that holds real tokens; padding every
micro-batch to its longest row is the baseline (``padding_efficiency``). Called by the training
backend; pure apart from torch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Packs as lists of row indices; every row appears exactly once."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1 (got {budget})")
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for p, free in enumerate(room):
            if n <= free:
                packs[p].append(i)
                room[p] -= n
                break
        else:
            packs.append([i])
            room.append(max(budget - n, 0))
    return packs


def packed_inputs(rows_ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input_ids [1, L], position_ids [1, L], start offset of each row) for one pack."""
    starts, pos, offset = [], [], 0
    for ids in rows_ids:
        starts.append(offset)
        pos.append(torch.arange(len(ids), dtype=torch.long))
        offset += len(ids)
    return torch.cat(list(rows_ids))[None], torch.cat(pos)[None], starts


def unpack_logprobs(pack_lp: torch.Tensor, starts: Sequence[int], lengths: Sequence[int], width: int) -> torch.Tensor:
    """Per-token logprobs of a pack ([L], position j holds logp(token j | tokens before it)) as
    [rows, width] with each row's first position 0 (its predecessor belongs to another row)."""
    out = pack_lp.new_zeros((len(starts), width))
    for r, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        if n > 1:
            out[r, 1:n] = pack_lp[s + 1 : s + n]
    return out


def packing_efficiency(lengths: Sequence[int], packs: Sequence[Sequence[int]], budget: int) -> float:
    """Real tokens / tokens the packs could hold (a pack over budget counts its own length)."""
    capacity = sum(max(budget, sum(lengths[i] for i in p)) for p in packs)
    return sum(lengths) / capacity if capacity else 1.0


def padding_efficiency(lengths: Sequence[int], micro_batch_size: int) -> float:
    """Real tokens / tokens computed when micro-batches of consecutive rows pad to their longest."""
    total = sum(
        len(chunk) * max(chunk)
        for chunk in (lengths[i : i + micro_batch_size] for i in range(0, len(lengths), micro_batch_size))
    )
    return sum(lengths) / total if total else 1.0

"""Sequence packing against padding, part of the pipeline-efficiency section (`streamrl.bench.pipeline`).

A step's sequence lengths drawn log-normal (SWE-like, clipped to the context length), packed
first-fit decreasing into packs of one context length (`services.trainer.packing`), against
padding micro-batches to their longest row. No services run.
"""

from __future__ import annotations

import math
import statistics

import msgspec
import numpy as np


class PackingCase(msgspec.Struct, frozen=True, kw_only=True):
    rows: int = 512  # one step: 32 prompts x 16 rollouts
    median_tokens: int = 6000
    sigma: float = 1.0
    max_len: int = 32768  # token budget of a pack and the context length rows are clipped to
    micro_batch_size: int = 8
    batches: int = 20

    @property
    def micro_batches(self) -> float:
        """Micro-batches of a padded batch (rows over the micro-batch size)."""
        return self.rows / self.micro_batch_size


class PackingResults(msgspec.Struct):
    """Non-padding fractions over the batches, and packs per batch against their lower bound."""

    case: PackingCase
    packing_mean: float
    packing_min: float
    padding_mean: float
    padding_min: float
    packs_mean: float
    packs_lower_bound_mean: float  # total tokens over the pack budget, rounded up


def packing_lengths(case: PackingCase, seed: int) -> list[int]:
    z = np.random.default_rng(seed).standard_normal(case.rows)
    return [int(min(case.max_len, max(1, round(case.median_tokens * math.exp(case.sigma * x))))) for x in z]


def packing_benchmark(case: PackingCase | None = None) -> PackingResults:
    from services.trainer.packing import first_fit_decreasing, packing_efficiency, padding_efficiency

    case = case or PackingCase()
    packed, padded, packs, lower = [], [], [], []
    for seed in range(case.batches):
        lengths = packing_lengths(case, seed)
        p = first_fit_decreasing(lengths, case.max_len)
        packed.append(packing_efficiency(lengths, p, case.max_len))
        padded.append(padding_efficiency(lengths, case.micro_batch_size))
        packs.append(len(p))
        lower.append(math.ceil(sum(lengths) / case.max_len))
    return PackingResults(
        case=case,
        packing_mean=statistics.mean(packed),
        packing_min=min(packed),
        padding_mean=statistics.mean(padded),
        padding_min=min(padded),
        packs_mean=statistics.mean(packs),
        packs_lower_bound_mean=statistics.mean(lower),
    )

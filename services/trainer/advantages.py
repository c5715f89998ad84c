"""GRPO advantages, computed per explicit group id (never by prompt tokens or row position).

For row i of a group with rewards r:
  leave-one-out (default): b_i = mean of the other rows' rewards;  otherwise: b = group mean.
  A_i = r_i - b_i, divided by (s + 1e-6) when ``normalize`` and s > 0, where s is the sample std of
  the whole group. One s for the whole group keeps the advantages of a group summing to zero. (A
  per-row std of the *other* rows does not: in a group with a single success that row's "others"
  all scored 0, so it would stay unscaled while every failure is scaled up, and the net push on the
  tokens all rows share, such as the tool-call format, turns negative and erodes it.)
A group of one row gets A = 0. Placeholder rows (backfilled failures, ``is_placeholder``) are left
out of their siblings' baselines and get A = 0, so an infrastructure failure neither rewards nor
punishes the healthy rows. Rows masked out of the loss for other reasons (env-flagged, logprob
mismatch) still count in the baseline: they are real samples of the policy.

Positional grouping (row i is in group i // G) is only a fallback for ordered external batches
whose rows carry no group id (``""``): it needs contiguous blocks of exactly G rows, and a batch
that is not a whole number of groups is an error, never a silent per-row grouping (which would give
every row a zero advantage). Mixing rows with and without ids is an error too.

Called by the batch builder; pure (numpy in, numpy out).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

EPS = 1e-6


def group_advantages(
    rewards: npt.ArrayLike,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    is_placeholder: npt.ArrayLike | None = None,
) -> np.ndarray:
    """Advantages of one group's rows, in the given order."""
    r = np.asarray(rewards, dtype=np.float64)
    real = ~np.asarray(is_placeholder, dtype=bool) if is_placeholder is not None else np.ones(len(r), dtype=bool)
    adv = np.zeros(len(r), dtype=np.float64)
    idx = np.flatnonzero(real)
    n = len(idx)
    if n < 2:
        return adv.astype(np.float32)
    rr = r[idx]
    base = (rr.sum() - rr) / (n - 1) if leave_one_out else np.full(n, rr.mean())
    a = rr - base
    std = rr.std(ddof=1)
    if normalize and std > 0:
        a = a / (std + EPS)
    adv[idx] = a
    return adv.astype(np.float32)


def batch_advantages(
    group_ids: Sequence[str],
    rewards: Sequence[float],
    *,
    group_size: int,
    leave_one_out: bool = True,
    normalize: bool = True,
    is_placeholder: Sequence[bool] | None = None,
) -> np.ndarray:
    """Advantages for a batch of rows grouped by their explicit ``group_ids``.

    Every group must hold exactly ``group_size`` rows: a wrong size means rows were lost or mixed
    up upstream, and silently computing baselines over it would corrupt the update.
    """
    group_ids = resolve_group_ids(group_ids, group_size)
    reward_of = np.asarray(rewards, dtype=np.float64)
    placeholder = np.asarray(is_placeholder if is_placeholder is not None else [False] * len(reward_of), dtype=bool)
    out = np.zeros(len(reward_of), dtype=np.float32)
    members: dict[str, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    for gid, idx in members.items():
        if len(idx) != group_size:
            raise ValueError(f"group {gid!r} has {len(idx)} rows in the batch, expected {group_size}")
        out[idx] = group_advantages(
            reward_of[idx], leave_one_out=leave_one_out, normalize=normalize, is_placeholder=placeholder[idx]
        )
    return out


def resolve_group_ids(group_ids: Sequence[str], group_size: int) -> list[str]:
    """The explicit ids; positional ids (``pos:<i // G>``) when no row carries one."""
    missing = [i for i, g in enumerate(group_ids) if not g]
    if not missing:
        return list(group_ids)
    if len(missing) != len(group_ids):
        raise ValueError(f"rows {missing[:5]} carry no group id while others do; cannot group the batch")
    n = len(group_ids)
    if group_size < 1 or n % group_size:
        raise ValueError(
            f"{n} rows without group ids are not whole groups of {group_size}; positional grouping needs "
            "contiguous blocks of num_generations_per_prompt rows"
        )
    return [f"pos:{i // group_size}" for i in range(n)]

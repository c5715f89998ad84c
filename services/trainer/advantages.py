"""GRPO advantages, computed per explicit group id (never by prompt tokens or row position).

For row i of a group with rewards r:
  leave-one-out (default): b_i = mean of the other rows' rewards, s_i = their sample std;
  otherwise:               b   = group mean,                      s   = group sample std.
  A_i = r_i - b_i, divided by (s_i + 1e-6) when ``normalize`` and s_i > 0.
A group of one row gets A = 0. Placeholder rows (backfilled failures, ``is_placeholder``) are left
out of their siblings' baselines and get A = 0, so an infrastructure failure neither rewards nor
punishes the healthy rows. Rows masked out of the loss for other reasons (env-flagged, logprob
mismatch) still count in the baseline: they are real samples of the policy.

Called by the batch builder; pure (numpy in, numpy out).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-6


def group_advantages(
    rewards: Sequence[float],
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    is_placeholder: Sequence[bool] | None = None,
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
    if leave_one_out:
        total = rr.sum()
        base = (total - rr) / (n - 1)
        if n > 2:
            sq = (rr**2).sum()
            # sample variance of the other n-1 rows
            mean_o = base
            var_o = ((sq - rr**2) - (n - 1) * mean_o**2) / (n - 2)
            std = np.sqrt(np.clip(var_o, 0.0, None))
        else:
            std = np.zeros(n)
    else:
        base = np.full(n, rr.mean())
        std = np.full(n, rr.std(ddof=1))
    a = rr - base
    if normalize:
        scale = np.where(std > 0, std + EPS, 1.0)
        a = a / scale
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
    rewards = np.asarray(rewards, dtype=np.float64)
    placeholder = np.asarray(is_placeholder if is_placeholder is not None else [False] * len(rewards), dtype=bool)
    out = np.zeros(len(rewards), dtype=np.float32)
    members: dict[str, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    for gid, idx in members.items():
        if len(idx) != group_size:
            raise ValueError(f"group {gid!r} has {len(idx)} rows in the batch, expected {group_size}")
        out[idx] = group_advantages(
            rewards[idx], leave_one_out=leave_one_out, normalize=normalize, is_placeholder=placeholder[idx]
        )
    return out

"""Packed token arrays: token ids as little-endian int32 bytes, logprobs as little-endian float32.

Every message that carries tokens across a process boundary uses these, not msgpack lists of
numbers (decode is several times faster and entries are smaller). Callers: the protocol Structs'
helpers, the gateway when it assembles trajectories, the trainer when it builds batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids -> int32 little-endian bytes."""
    return np.asarray(ids, dtype=_I32).tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """int32 little-endian bytes -> read-only int32 array (no copy)."""
    if len(data) % 4:
        raise ValueError(f"packed token ids have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=_I32)


def pack_logprobs(values: Sequence[float] | np.ndarray) -> bytes:
    """Logprobs -> float32 little-endian bytes."""
    return np.asarray(values, dtype=_F32).tobytes()


def unpack_logprobs(data: bytes) -> np.ndarray:
    """float32 little-endian bytes -> read-only float32 array (no copy)."""
    if len(data) % 4:
        raise ValueError(f"packed logprobs have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=_F32)

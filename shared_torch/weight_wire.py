"""The wire format of a collective weight transfer over a gloo group (no vLLM import here).

Derived from the parameter list alone, so nothing but names, dtypes and shapes crosses the
control plane::

    params (metadata order) --split--> buckets of <= bucket_bytes (a larger tensor travels alone)
    per bucket: broadcast(flat uint8 buffer) from rank 0, then broadcast(16-byte xxh3-128 digest)

The receiver checks each bucket's digest before loading it, so a torn or corrupted transfer fails
loudly instead of serving garbage; the digest over all bucket digests (`transfer_checksum`) is
what both sides report for the version. Every broadcast is bounded by the group's timeout.
Used by the vLLM engines of `shared_torch.gloo_weights` and by the transformers fallback engine.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import xxhash

from shared.netaddr import ADVERTISE_ENV, this_host

DEFAULT_BUCKET_BYTES = 256 << 20
DIGEST_BYTES = 16


class TransferError(RuntimeError):
    """A weight transfer failed: a peer is gone, a bucket arrived corrupted, or the sides disagree."""


class Meta(Protocol):
    """What the wire needs of one parameter (vLLM's ``ParamMeta`` has these fields)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def nbytes(dtype: torch.dtype | str, shape: Iterable[int]) -> int:
    """Bytes of a tensor of ``dtype`` (or its name, as in an update message) and ``shape``."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    n = 1
    for s in shape:
        n *= int(s)
    return n * int(torch.empty((), dtype=dtype).element_size())


def plan_buckets(metas: Sequence[Meta], bucket_bytes: int) -> list[list[int]]:
    """Indices into ``metas`` per bucket, in order: consecutive parameters up to ``bucket_bytes``
    (a parameter larger than that is a bucket of its own). Both sides compute the same plan."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, m in enumerate(metas):
        n = nbytes(m.dtype, m.shape)
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def digest(buf: torch.Tensor) -> bytes:
    """xxh3-128 of a flat uint8 CPU tensor's bytes."""
    return xxhash.xxh3_128_digest(memoryview(buf.numpy()))


def transfer_checksum(bucket_digests: Iterable[bytes]) -> str:
    """The version's checksum: xxh3-128 over its bucket digests, in order."""
    h = xxhash.xxh3_128()
    for d in bucket_digests:
        h.update(d)
    return "xxh3_128:" + h.hexdigest()


def metas_from_update(names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> list[ParamSpec]:
    """The parameter list of an update message (vLLM's names/dtype_names/shapes lists)."""
    return [ParamSpec(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtype_names, shapes, strict=True)]


def checksum_of_checksums(per_worker: list[dict[str, str]]) -> str:
    """One digest of vLLM's per-parameter checksums (``compute_weight_checksums``), name-sorted."""
    h = xxhash.xxh3_128()
    for sums in per_worker:
        for name in sorted(sums):
            h.update(name.encode())
            h.update(sums[name].encode())
    return "xxh3_128:" + h.hexdigest()


def open_group(address: str, port: int, rank: int, world_size: int, group_id: str, timeout_s: float) -> Group:
    """A gloo process group of its own (not torch's default group, which a trainer already uses),
    rendezvous through rank 0's TCP store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # a peer's advertised address this host cannot reach
        raise RuntimeError(
            f"transfer group {group_id}: cannot reach trainer rank 0 at {address}:{port} from host {this_host()} "
            f"within {timeout_s:.0f}s: {exc}"
        ) from exc
    given = os.environ.get(ADVERTISE_ENV, "").strip()
    if given:  # gloo's connections on the address this host is reached at, not whatever its name resolves to
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=given)]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(group_id, store), rank, world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(group_id, store), rank, world_size, timeout)
    return Group(pg, store)


@dataclass
class Group:
    pg: Any
    store: Any  # kept alive as long as the group: rank 0 hosts the rendezvous

    def broadcast(self, t: torch.Tensor) -> None:
        self.start_broadcast(t).wait()

    def start_broadcast(self, t: torch.Tensor) -> Any:
        """Post a broadcast from rank 0 without waiting; its work's ``wait()`` completes it. Every
        member posts the group's broadcasts in the same order."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([t], opts)

    def close(self) -> None:
        """Drop the group: its connections close and peers fail at once, not at the timeout. Only
        when nothing else holds it: a posted broadcast's work keeps the group alive (and so the
        peers waiting), which is why `wait_all` and `receive_buckets` drop their works on failure."""
        self.pg = None
        self.store = None


def wait_all(works: list[Any]) -> None:
    """Wait for posted works in order. On failure the rest are dropped before the error rises:
    the traceback keeps this frame alive, and a work it held would keep the group connected."""
    try:
        while works:
            works.pop(0).wait()
    except BaseException:
        works.clear()
        raise


def max_bucket_bytes(metas: Sequence[Meta], bucket_bytes: int) -> int:
    """The size of the largest bucket of the plan (the buffer a transfer needs)."""
    return max(
        (sum(nbytes(metas[i].dtype, metas[i].shape) for i in b) for b in plan_buckets(metas, bucket_bytes)), default=0
    )


def bucket_buffer(current: torch.Tensor | None, size: int) -> torch.Tensor:
    """A byte buffer of at least ``size`` bytes: ``current`` when it is large enough. Kept across
    buckets and transfers: writing into fresh memory costs a page fault per page, which on a large
    model costs as much as the copy itself."""
    if current is not None and current.numel() >= size:
        return current
    return torch.empty(size, dtype=torch.uint8)


def receive_buckets(
    group: Group,
    metas: Sequence[Meta],
    bucket_bytes: int,
    buffers: list[torch.Tensor] | None = None,
    *,
    keep: bool = False,
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bytes]]:
    """Receive every bucket from rank 0, check its digest, yield its (name, tensor) pairs and the
    digest. The next bucket arrives while the caller loads this one. By default two receive
    buffers alternate (``buffers``, grown as needed, kept by the caller across transfers) and the
    pairs are views into one: the caller copies them out before it asks for the next bucket.
    With ``keep`` each bucket lands in memory of its own that the caller may keep (no copy: a
    caller that would copy every tensor out saves a pass over the bytes; ``buffers`` is unused)."""
    buckets = plan_buckets(metas, bucket_bytes)
    sizes = [[nbytes(metas[i].dtype, metas[i].shape) for i in bucket] for bucket in buckets]
    if buffers is None:
        buffers = []
    if not keep:
        need = max_bucket_bytes(metas, bucket_bytes)
        while len(buffers) < 2:
            buffers.append(torch.empty(0, dtype=torch.uint8))
        for k in range(2):
            buffers[k] = bucket_buffer(buffers[k], need)
    landing: dict[int, torch.Tensor] = {}  # bucket -> the memory it is received into
    digests = [torch.empty(DIGEST_BYTES, dtype=torch.uint8) for _ in range(2)]

    def post(k: int) -> tuple[Any, Any]:
        n = sum(sizes[k])
        landing[k] = torch.empty(n, dtype=torch.uint8) if keep else buffers[k % 2][:n]
        return group.start_broadcast(landing[k]), group.start_broadcast(digests[k % 2])

    posted = list(post(0)) if buckets else []
    for k, bucket in enumerate(buckets):
        wait_all(posted)
        buf = landing.pop(k)
        got = digest(buf)
        sent = bytes(digests[k % 2].numpy())
        posted = list(post(k + 1)) if k + 1 < len(buckets) else []  # the next bucket lands meanwhile
        if got != sent:
            posted.clear()
            first = metas[bucket[0]].name
            raise TransferError(f"a weight bucket arrived corrupted (digest mismatch; bucket starting at {first!r})")
        out: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for i, n in zip(bucket, sizes[k], strict=True):
            m = metas[i]
            out.append((m.name, buf[offset : offset + n].view(m.dtype).view(m.shape)))
            offset += n
        del buf
        yield out, got

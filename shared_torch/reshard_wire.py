"""The wire of a refit without a gather: point-to-point links from trainer ranks to engine ranks
over one gloo group (no vLLM import here).

The resharding plan (`services.trainer.reshard_plan`) says which boxes of which published tensor
each trainer rank sends each engine rank. Per link (one trainer rank -> one engine rank) those
pieces travel in order, packed into buckets::

    link pieces (plan order, each <= slot bytes) --> buckets of <= slot bytes
    per bucket: send(payload || xxh3-128 digest of the payload), tag = the bucket's number

Both sides hold the same list of buckets per link (`Links`: the trainer computes it and hands the
receivers theirs), so nothing but the bytes crosses the group. A sender keeps a fixed number of
slot buffers (their bytes together are the transfer's bucket size) and posts its links' buckets
round-robin, so all its links carry bytes at once; a receiver takes each link on a thread of its
own, checks every bucket's digest, writes each piece into its published tensor and hands a tensor
on as soon as every piece of it has arrived. The digests of a link's buckets make the link's
checksum; an engine rank's checksum is over its links in trainer-rank order (`rank_checksum`), a
generator's over its engine ranks in order (`engine_checksum`): what its ack reports and what the
trainer, which knows every link's checksum, expects.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from shared.boxes import Box, volume
from shared_torch.reshard_delta import HEADER_BYTES, DeltaState, body_bytes
from shared_torch.weight_wire import DIGEST_BYTES, Group, TransferError, digest

Piece = tuple[str, Box]  # a box of a published tensor
Bucket = list[Piece]
Links = dict[int, list[Bucket]]  # peer's rank in the group -> the link's buckets, in order


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in box)


def buckets_of(pieces: Sequence[Piece], itemsize: int, slot_bytes: int) -> list[Bucket]:
    """Consecutive pieces up to ``slot_bytes`` a bucket (a piece is never larger: the plan cuts
    its boxes to fit)."""
    out: list[Bucket] = []
    size = 0
    for piece in pieces:
        n = volume(piece[1]) * itemsize
        if n > slot_bytes:
            raise ValueError(f"piece {piece[0]} {piece[1]} ({n} bytes) is larger than a slot ({slot_bytes})")
        if not out or size + n > slot_bytes:
            out.append([])
            size = 0
        out[-1].append(piece)
        size += n
    return out


def encode_links(links: Links) -> list[list[Any]]:
    """``links`` as JSON-able lists (what an init message carries)."""
    return [
        [peer, [[[name, [list(r) for r in box]] for name, box in b] for b in buckets]]
        for peer, buckets in links.items()
    ]


def decode_links(data: Iterable[Sequence[Any]]) -> Links:
    return {
        int(peer): [[(str(name), tuple((int(s), int(e)) for s, e in box)) for name, box in b] for b in buckets]
        for peer, buckets in data
    }


def link_checksum(digests: Iterable[bytes]) -> str:
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d)
    return h.hexdigest()


def rank_checksum(link_sums: dict[int, str]) -> str:
    """An engine rank's checksum: over its links' checksums in trainer-rank order."""
    return link_checksum(link_sums[peer].encode() for peer in sorted(link_sums))


def engine_checksum(rank_sums: Sequence[str]) -> str:
    """A generator's checksum: over its engine ranks' checksums in rank order."""
    return "xxh3_128:" + link_checksum(s.encode() for s in rank_sums)


@dataclass(frozen=True)
class ReshardSent:
    """What rank 0 learned of a resharding transfer from every trainer rank's report."""

    checksums: dict[str, str]  # generator -> the checksum its ack must carry
    elements: int  # elements sent (whole payloads)
    changed: int  # of them, changed since the engine's version (all of them without delta)
    wire_bytes: int  # bytes that crossed the links


@dataclass
class _Slot:
    buffer: torch.Tensor
    work: list[Any] | None = None
    keep: Any = None  # what a posted delta send reads from


def send_links(
    group: Group,
    links: Links,
    fill: Callable[[Piece, torch.Tensor], None],
    dtype: torch.dtype,
    slots: list[torch.Tensor],
    delta: DeltaState | None = None,
) -> dict[int, str]:
    """Send every link's buckets, round-robin over the links, through the slot buffers ``slots``
    (each at least a bucket plus its digest); ``fill(piece, out)`` writes a piece's values into
    ``out`` (the piece's box shape, ``dtype``). With ``delta`` each bucket goes as its changed
    elements (`shared_torch.reshard_delta`). Returns each link's checksum. A failed send drops
    every posted work (a work keeps the group connected) and raises `TransferError`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool = [_Slot(s) for s in slots]
    order = [(peer, k) for k in range(max((len(b) for b in links.values()), default=0)) for peer in links]
    order = [(peer, k) for peer, k in order if k < len(links[peer])]
    digests: dict[int, list[bytes]] = defaultdict(list)
    try:
        for i, (peer, k) in enumerate(order):
            slot = pool[i % len(pool)]
            if slot.work is not None:
                works, slot.work = slot.work, None
                for work in works:
                    work.wait()
            buf, offset = slot.buffer, 0
            for name, box in links[peer][k]:
                n = volume(box) * itemsize
                fill((name, box), buf[offset : offset + n].view(dtype).view([e - s for s, e in box]))
                offset += n
            d = digest(buf[:offset])
            if delta is not None:
                header, body = delta.encode((peer, k), buf[:offset], itemsize, d)
                slot.work = [group.pg.send([header], peer, 2 * k), group.pg.send([body], peer, 2 * k + 1)]
                slot.keep = (header, body)
            else:
                buf[offset : offset + DIGEST_BYTES].copy_(torch.frombuffer(bytearray(d), dtype=torch.uint8))
                slot.work = [group.pg.send([buf[: offset + DIGEST_BYTES]], peer, k)]
            digests[peer].append(d)
        for slot in pool:
            if slot.work is not None:
                works, slot.work = slot.work, None
                for work in works:
                    work.wait()
    except Exception as exc:
        for slot in pool:
            slot.work = None
        raise TransferError(f"sending weights to group rank {peer}: {exc}") from exc
    return {peer: link_checksum(digests[peer]) for peer in links}


def slot_buffers(current: list[torch.Tensor], count: int, slot_bytes: int) -> list[torch.Tensor]:
    """``count`` byte buffers of a slot and its digest each, ``current``'s where large enough
    (kept across transfers: fresh memory costs a page fault per page)."""
    need = slot_bytes + DIGEST_BYTES
    out = [b for b in current if b.numel() >= need][:count]
    return out + [torch.empty(need, dtype=torch.uint8) for _ in range(count - len(out))]


def receive_links(
    group: Group,
    links: Links,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    slot_bytes: int,
    take: Callable[[str, torch.Tensor], None],
    delta: DeltaState | None = None,
) -> str:
    """Receive every link at once (a thread each), write each piece into its published tensor
    (allocated on its first piece; on the CPU its pages are only touched where pieces land), and
    call ``take(name, tensor)`` on this thread once all of a tensor's pieces arrived. Returns this
    rank's checksum (`rank_checksum`). Raises `TransferError` on a failed receive or a corrupted
    bucket (the other links' threads end at their next receive, at the latest at the group's
    timeout)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    remaining: dict[str, int] = defaultdict(int)
    for buckets in links.values():
        for bucket in buckets:
            for name, box in bucket:
                remaining[name] += volume(box)
    targets: dict[str, torch.Tensor] = {}
    lock = threading.Lock()
    events: queue.Queue[tuple[str, int] | BaseException | None] = queue.Queue()
    sums: dict[int, str] = {}

    def target(name: str) -> torch.Tensor:
        with lock:
            if name not in targets:
                targets[name] = torch.empty(shapes[name], dtype=dtype)
            return targets[name]

    def payloads(peer: int, buckets: list[Bucket]) -> Iterator[tuple[torch.Tensor, bytes]]:
        """Each bucket's payload from ``peer`` and its digest, checked; the next bucket is on its
        way while the caller unpacks this one."""
        sizes = [sum(volume(box) for _, box in b) * itemsize for b in buckets]
        if delta is not None:
            for k, n in enumerate(sizes):
                header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
                group.pg.recv([header], peer, 2 * k).wait()
                body = torch.empty(body_bytes(header), dtype=torch.uint8)
                group.pg.recv([body], peer, 2 * k + 1).wait()
                payload = delta.decode((peer, k), header, body, itemsize, n)
                yield payload, bytes(header[16:].numpy())
            return
        bufs = [torch.empty(slot_bytes + DIGEST_BYTES, dtype=torch.uint8) for _ in range(2)]
        posted = group.pg.recv([bufs[0][: sizes[0] + DIGEST_BYTES]], peer, 0) if buckets else None
        for k, n in enumerate(sizes):
            assert posted is not None
            posted.wait()
            buf = bufs[k % 2]
            posted = None
            if k + 1 < len(buckets):
                posted = group.pg.recv([bufs[(k + 1) % 2][: sizes[k + 1] + DIGEST_BYTES]], peer, k + 1)
            d = digest(buf[:n])
            if d != bytes(buf[n : n + DIGEST_BYTES].numpy()):
                raise TransferError(f"a weight bucket from group rank {peer} arrived corrupted (digest mismatch)")
            yield buf[:n], d

    def run(peer: int, buckets: list[Bucket]) -> None:
        try:
            got: list[bytes] = []
            for bucket, (payload, d) in zip(buckets, payloads(peer, buckets), strict=True):
                got.append(d)
                offset = 0
                for name, box in bucket:
                    m = volume(box) * itemsize
                    piece = payload[offset : offset + m].view(dtype).view([e - s for s, e in box])
                    target(name)[slices(box)].copy_(piece)
                    offset += m
                    events.put((name, volume(box)))
            sums[peer] = link_checksum(got)
            events.put(None)
        except BaseException as exc:
            events.put(exc)

    threads = [threading.Thread(target=run, args=(p, b), daemon=True, name=f"link-{p}") for p, b in links.items()]
    for t in threads:
        t.start()
    done = 0
    while done < len(threads):
        event = events.get()
        if event is None:
            done += 1
        elif isinstance(event, BaseException):
            if isinstance(event, TransferError):
                raise event
            raise TransferError(f"receiving weights: {event}") from event
        else:
            name, n = event
            remaining[name] -= n
            if remaining[name] == 0:
                with lock:
                    tensor = targets.pop(name)
                take(name, tensor)
    for t in threads:
        t.join()
    return rank_checksum(sums)

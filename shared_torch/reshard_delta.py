"""Changed bytes only (``refit.collective.delta``): a resharding link sends each bucket as the
elements that changed since the version the engine rank holds, bit-exact.

Both ends of a link keep the last payload of each of its buckets (the trainer rank what it sent,
the engine rank what it rebuilt). From the second transfer of a group on, a bucket travels as a
fixed 32-byte header (mode, body bytes, the xxh3-128 digest of the whole new payload) and a body:
the whole payload (mode 0: the first transfer, or when the change is too large to gain), or a
bitmap of the changed elements followed by their new values (mode 1). The receiver rebuilds the
payload from its copy and checks the digest, so a delta that went wrong fails loudly instead of
serving a blend of versions. Elements compare by their bits (a bfloat16 that rounds to the same
value is unchanged). A new group starts both ends afresh (whole payloads), so they never disagree
on the version a delta is against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared_torch.weight_wire import DIGEST_BYTES, TransferError, digest

HEADER_BYTES = 16 + DIGEST_BYTES
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class DeltaState:
    """One side's last payload of each bucket of its links ((peer, bucket) -> bytes) and what the
    last transfer changed."""

    previous: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    elements: int = 0
    changed: int = 0
    wire_bytes: int = 0

    def start(self) -> None:
        self.elements = self.changed = self.wire_bytes = 0

    def encode(
        self, key: tuple[int, int], payload: torch.Tensor, itemsize: int, payload_digest: bytes
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, body) of one bucket's ``payload`` (uint8); keeps a copy of it for the next."""
        n = payload.numel() // itemsize
        old = self.previous.get(key)
        mode, body = 0, payload
        changed = n
        if old is not None and old.numel() == payload.numel():
            mask = payload.view(_BITS[itemsize]).ne(old.view(_BITS[itemsize]))
            changed = int(mask.sum())
            bitmap = np.zeros(_bitmap_bytes(n), dtype=np.uint8)
            packed = np.packbits(mask.numpy())
            bitmap[: packed.size] = packed
            if bitmap.size + changed * itemsize < payload.numel():
                values = payload.view(_BITS[itemsize])[mask].view(torch.uint8)
                body = torch.cat([torch.from_numpy(bitmap), values])
                mode = 1
        self.previous[key] = payload.clone()
        self.elements += n
        self.changed += changed
        self.wire_bytes += body.numel()
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:16].view(torch.int64).copy_(torch.tensor([mode, body.numel()]))
        header[16:].copy_(torch.frombuffer(bytearray(payload_digest), dtype=torch.uint8))
        return header, body

    def decode(
        self, key: tuple[int, int], header: torch.Tensor, body: torch.Tensor, itemsize: int, size: int
    ) -> torch.Tensor:
        """The bucket's whole payload (``size`` bytes) from its header and body; raises
        `TransferError` when it does not match the digest the sender took."""
        mode = int(header[:16].view(torch.int64)[0])
        if mode == 0:
            payload = body
        else:
            old = self.previous.get(key)
            if old is None or old.numel() != size:
                raise TransferError(f"a delta for bucket {key} arrived with no previous payload to apply it to")
            n = size // itemsize
            nbitmap = _bitmap_bytes(n)
            mask = torch.from_numpy(np.unpackbits(body[:nbitmap].numpy(), count=n).astype(bool))
            payload = old.clone()
            payload.view(_BITS[itemsize])[mask] = body[nbitmap:].view(_BITS[itemsize])
        if digest(payload) != bytes(header[16:].numpy()):
            raise TransferError(f"bucket {key} rebuilt from its delta does not match the sender's digest")
        self.previous[key] = payload
        return payload


def body_bytes(header: torch.Tensor) -> int:
    return int(header[:16].view(torch.int64)[1])


def _bitmap_bytes(n: int) -> int:
    """A bitmap of ``n`` elements, padded to 8 bytes (the values after it stay aligned)."""
    return -(-n // 64) * 8

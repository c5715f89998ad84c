"""The wire format of a collective weight transfer: the bucket plan both sides derive from the
parameter list, and the receiver's per-bucket digest check."""

import pytest
import torch

from shared_torch.weight_wire import (
    DIGEST_BYTES,
    ParamSpec,
    TransferError,
    digest,
    metas_from_update,
    nbytes,
    plan_buckets,
    receive_buckets,
    transfer_checksum,
)

pytestmark = pytest.mark.unit

METAS = [
    ParamSpec("a", torch.float32, (4, 4)),  # 64 bytes
    ParamSpec("b", torch.bfloat16, (8,)),  # 16 bytes
    ParamSpec("c", torch.float32, (40,)),  # 160 bytes: larger than a bucket, travels alone
    ParamSpec("d", torch.float32, (2,)),  # 8 bytes
]


def test_buckets_keep_order_and_bound_size():
    assert nbytes("bfloat16", [8]) == 16 and nbytes(torch.float32, (4, 4)) == 64
    assert plan_buckets(METAS, 100) == [[0, 1], [2], [3]]
    assert plan_buckets(METAS, 1 << 20) == [[0, 1, 2, 3]]
    assert plan_buckets(METAS, 1) == [[0], [1], [2], [3]]
    assert metas_from_update(["b"], ["bfloat16"], [[8]]) == [METAS[1]]


class FakeGroup:
    """Rank 0's side of the broadcasts, played from a list of payloads."""

    def __init__(self, payloads: list[torch.Tensor]) -> None:
        self.payloads = payloads

    def broadcast(self, t: torch.Tensor) -> None:
        t.copy_(self.payloads.pop(0))

    def start_broadcast(self, t: torch.Tensor):
        self.broadcast(t)
        return self

    def wait(self) -> None:
        pass


def _wire(tensors: dict[str, torch.Tensor], bucket_bytes: int, corrupt: int | None = None) -> list[torch.Tensor]:
    out = []
    for b, bucket in enumerate(plan_buckets(METAS, bucket_bytes)):
        buf = torch.cat([tensors[METAS[i].name].contiguous().view(-1).view(torch.uint8) for i in bucket])
        d = torch.frombuffer(bytearray(digest(buf)), dtype=torch.uint8)
        if b == corrupt:
            buf = buf.clone()
            buf[0] ^= 1  # one bit flipped in flight
        out += [buf, d]
    return out


def test_received_tensors_equal_the_sent_ones_and_a_flipped_bit_is_caught():
    g = torch.Generator().manual_seed(0)
    tensors = {m.name: torch.randn(m.shape, generator=g).to(m.dtype) for m in METAS}
    got, digests = {}, []
    for pairs, d in receive_buckets(FakeGroup(_wire(tensors, 100)), METAS, 100):
        got.update({n: t.clone() for n, t in pairs})
        digests.append(d)
        assert len(d) == DIGEST_BYTES
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert transfer_checksum(digests).startswith("xxh3_128:")
    with pytest.raises(TransferError, match="corrupted.*'c'"):
        for _ in receive_buckets(FakeGroup(_wire(tensors, 100, corrupt=1)), METAS, 100):
            pass


def test_kept_buckets_stay_intact_while_later_ones_arrive():
    """With ``keep`` the receiver hands out views the caller holds on to (vLLM's layer-wise reload
    keeps a layer's tensors until the layer is complete): later buckets must not overwrite them."""
    g = torch.Generator().manual_seed(1)
    tensors = {m.name: torch.randn(m.shape, generator=g).to(m.dtype) for m in METAS}
    kept: dict[str, torch.Tensor] = {}
    for pairs, _ in receive_buckets(FakeGroup(_wire(tensors, 100)), METAS, 100, keep=True):
        kept.update(pairs)  # no copy
    assert all(torch.equal(kept[n], t) for n, t in tensors.items())

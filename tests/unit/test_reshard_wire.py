"""The resharding refit's wire, end to end in one process: two trainer ranks (FSDP2 row shards of
the tiny Qwen3.5-MoE, whose experts are fused in the model and stored one by one) send along the
plan to the two engine ranks of a tensor-parallel generator over a real gloo group (threads as
ranks). Every engine rank must end up with exactly the published values of every box its vLLM
weight loaders read, and both sides must agree on each link's checksum; a corrupted bucket fails
loudly. Also the pieces underneath: strided views found from element indices, boxes cut to a slot.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from services.trainer.reshard_source import FsdpShards, strided
from shared.boxes import split, volume
from shared_torch.reshard_wire import decode_links, encode_links, receive_links, send_links, slices, slot_buffers
from shared_torch.weight_wire import TransferError, open_group


def test_strided_finds_the_view_of_a_box_and_refuses_a_gather():
    full = np.arange(4 * 6 * 5).reshape(4, 6, 5)
    assert strided(full[1:3, 2:5, 1:4]) == (full[1, 2, 1], (30, 5, 1))
    assert strided(full.transpose(2, 0, 1)[:, 1:3]) == (full[1, 0, 0], (1, 30, 5))
    assert strided(np.array([[0, 1], [2, 4]])) is None


@pytest.mark.parametrize("limit", [1, 7, 30, 31, 1000])
def test_a_box_cut_to_a_slot_is_tiled_in_order(limit):
    box = ((2, 5), (0, 4), (1, 4))
    parts = split(box, limit)
    assert all(volume(p) <= max(limit, 1) for p in parts)
    covered = np.zeros((5, 4, 4), dtype=int)
    for p in parts:
        covered[slices(p)] += 1
    want = np.zeros_like(covered)
    want[slices(box)] = 1
    assert (covered == want).all()


class _Rows:
    """A rank's FSDP2 state dict: each tensor's ``torch.chunk`` of rows."""

    def __init__(self, state: dict[str, torch.Tensor], world: int, rank: int) -> None:
        per = {n: -(-t.shape[0] // world) for n, t in state.items() if t.dim()}
        self._state = {n: t[rank * per[n] : (rank + 1) * per[n]] if t.dim() else t for n, t in state.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


@pytest.fixture(scope="module")
def sharded(tiny_hybrid_moe_dir):
    """The tiny Qwen3.5-MoE's model, its published tensors, and the plan into a TP2 engine."""
    from transformers import AutoModelForCausalLM

    from services.trainer.reshard_order import EngineNeeds, reshard_order
    from shared_torch.stored_names import as_stored

    model = AutoModelForCausalLM.from_pretrained(str(tiny_hybrid_moe_dir), dtype=torch.float32)
    published = dict(as_stored(model, model.state_dict().items()))
    shards = [FsdpShards(model, 2, r, frozenset()) for r in range(2)]
    needs = EngineNeeds(str(tiny_hybrid_moe_dir), engine="vllm", tensor_parallel_size=2, expert_parallel=False)
    needs.shapes = {n: tuple(t.shape) for n, t in published.items()}
    info = {"master_address": "127.0.0.1", "master_port": 0, "world_size": 4, "group_id": "t", "timeout_s": 30}
    order, plan = reshard_order(
        shards[0].holdings(),
        needs,
        ["gen"],
        trainer_ranks=2,
        dtype="bfloat16",
        itemsize=2,
        bucket_bytes=64 << 10,
        generator_info=info,
    )
    for r, s in enumerate(shards):
        s.prepare(p for buckets in order.links.get(r, {}).values() for b in buckets for p in b)
        s.model = _Rows(model.state_dict(), 2, r)  # what FSDP2 leaves each rank
    return published, shards, order, needs, model


def _run(order, shards, shapes, deltas=None, timeout_s: float = 30.0):
    from streamrl.redis_server import free_port

    port = free_port()
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            group = open_group("127.0.0.1", port, r, 4, "t", timeout_s)
            delta = deltas[r] if deltas else None
            if r < 2:
                slots = slot_buffers([], 4, order.slot_bytes)
                results[r] = send_links(group, order.links[r], shards[r].reader(), torch.bfloat16, slots, delta)
            else:
                got: dict[str, torch.Tensor] = {}
                links = decode_links(order.workers["receives"]["gen"][r - 2])
                take = got.__setitem__
                checksum = receive_links(group, links, shapes, torch.bfloat16, order.slot_bytes, take, delta)
                results[r] = (checksum, got)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_each_engine_rank_receives_exactly_what_its_loaders_read(sharded):
    from shared_torch.reshard_wire import engine_checksum, rank_checksum

    published, shards, order, needs, _ = sharded
    assert encode_links(decode_links(encode_links(order.links[0]))) == encode_links(order.links[0])
    results = _run(order, shards, needs.shapes)
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    for engine_rank in range(2):
        checksum, got = results[2 + engine_rank]
        reads = needs.per_rank()[engine_rank]
        assert set(got) == set(reads)
        for name, boxes in reads.items():
            want = published[name].to(torch.bfloat16)
            for box in boxes:
                assert torch.equal(got[name][slices(box)], want[slices(box)]), (engine_rank, name, box)
        sent = {r: results[r][2 + engine_rank] for r in range(2) if 2 + engine_rank in results[r]}
        assert checksum == rank_checksum(sent)
    assert engine_checksum([results[2][0], results[3][0]]).startswith("xxh3_128:")


def test_a_corrupted_bucket_fails_the_receiving_rank(sharded, monkeypatch):
    import shared_torch.reshard_wire as wire

    published, shards, order, needs, _ = sharded
    real = wire.digest
    calls = {"n": 0}

    def flipped(buf):
        calls["n"] += 1
        d = real(buf)
        return bytes([d[0] ^ 1]) + d[1:] if calls["n"] == 3 else d

    monkeypatch.setattr(wire, "digest", flipped)
    results = _run(order, shards, needs.shapes, timeout_s=5.0)
    failures = [r for r in results.values() if isinstance(r, TransferError)]
    assert any("corrupted" in str(f) for f in failures), results


def test_a_second_transfer_sends_only_what_changed_and_rebuilds_it_bit_exact(sharded):
    """``refit.collective.delta``: the first transfer of a group goes whole, the next sends the
    changed elements only (a bitmap and their values); every engine rank rebuilds the new values
    exactly (its digest check would fail otherwise, and the boxes are compared here)."""
    from shared_torch.reshard_delta import DeltaState
    from shared_torch.stored_names import as_stored

    _, shards, order, needs, model = sharded
    deltas = {r: DeltaState() for r in range(4)}
    first = _run(order, shards, needs.shapes, deltas)
    assert not [r for r in first.values() if isinstance(r, Exception)], first
    assert deltas[0].changed == deltas[0].elements  # whole payloads first
    saved = {n: t.detach().clone() for n, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    try:
        with torch.no_grad():
            for t in model.state_dict().values():  # a step that moves 2% of the weights
                hit = torch.rand(t.shape, generator=gen) < 0.02
                t.add_(hit * 0.25)
        published = {n: t.to(torch.bfloat16) for n, t in as_stored(model, model.state_dict().items())}
        for d in deltas.values():
            d.start()
        second = _run(order, shards, needs.shapes, deltas)
    finally:
        with torch.no_grad():
            for n, t in model.state_dict().items():
                t.copy_(saved[n])
    assert not [r for r in second.values() if isinstance(r, Exception)], second
    for engine_rank in range(2):
        _, got = second[2 + engine_rank]
        for name, boxes in needs.per_rank()[engine_rank].items():
            for box in boxes:
                assert torch.equal(got[name][slices(box)], published[name][slices(box)]), (engine_rank, name, box)
    sent = sum(deltas[r].elements for r in range(2))
    changed = sum(deltas[r].changed for r in range(2))
    assert 0 < changed < 0.05 * sent
    assert sum(deltas[r].wire_bytes for r in range(2)) < 0.25 * sent * 2

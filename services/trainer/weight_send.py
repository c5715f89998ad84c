"""The learner's side of a collective refit: its weights as a vLLM `WeightSource`, sent by vLLM's
trainer-side weight-transfer engine.

Every trainer rank runs `CollectiveSender.send` for each transfer (the learner's commands see to
it). Rank 0 is the sender: it holds the transfer group with the generators and broadcasts; the
other ranks only iterate the source, which is their part of each FSDP gather (one tensor at a
time, so no rank holds the whole model). The engine is vLLM's, picked by the order's backend from
`vllm.distributed.weight_transfer.factory.WeightTransferTrainerFactory`: ``gloo``
(`shared_torch.gloo_weights`, CPU) or vLLM's ``nccl``. One engine lives per transfer group: a new group
id (membership changed, or the last transfer failed) closes the old one and opens the new.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.trainer.weight_export import as_published
from shared_torch.reshard_wire import ReshardSent as ReshardSent

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient

    from services.trainer.backends.base import TrainingBackend
    from shared_torch.reshard_wire import Links

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendOrder:
    """What every trainer rank needs to take part in one collective transfer."""

    group_id: str
    backend: str  # vLLM trainer-side engine: gloo or nccl
    master_address: str
    master_port: int
    world_size: int  # the sender and every generator worker
    timeout_s: float
    bucket_bytes: int
    reshard: ReshardOrder | None = None  # a transfer along a resharding plan (backend gloo_reshard)


@dataclass(frozen=True)
class ReshardOrder:
    """What the trainer's ranks need of a resharding plan (`services.trainer.reshard_order`)."""

    trainer_ranks: int
    dtype: str
    slot_bytes: int
    slots: int
    links: dict[int, Links]  # trainer rank -> its links (engine group rank -> buckets)
    generators: dict[str, list[int]]  # worker -> its engine ranks' group ranks
    workers: dict[str, Any]  # the generators' init info
    total_bytes: int
    delta: bool = False  # changed bytes only (`shared_torch.reshard_delta`)


def weight_source(backend: TrainingBackend, dtype: torch.dtype) -> Any:
    """``backend``'s policy as a vLLM `WeightSource`: its `weight_metadata` announced in ``dtype``,
    its `weight_tensors` sent (collective over the trainer's ranks: every rank iterates it)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    metas = [ParamMeta(name, dtype, shape) for name, shape in backend.weight_metadata()]

    class BackendSource(WeightSource):  # type: ignore[misc]  # vLLM is untyped for mypy
        """The policy one tensor at a time, in the compute dtype on the CPU."""

        def metadata(self) -> list[ParamMeta]:
            return metas

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return ((name, as_published(t, dtype)) for name, t in backend.weight_tensors())

        def iter_uncast(self) -> Iterator[tuple[str, torch.Tensor]]:
            """The same tensors before the cast to the declared dtype (the gloo engine casts them
            as it copies them into its bucket buffer, so no cast copy is made)."""
            return backend.weight_tensors()

    return BackendSource()


class _NotTheSender:
    """The client of a trainer rank other than 0: never called (only the sender drives generators)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"trainer rank other than 0 asked to call {name} on the generators")


class CollectiveSender:
    """One trainer rank's vLLM trainer engine, kept per transfer group. ``source``: the policy as a
    stream of whole tensors (a broadcast); ``shards``: this rank's own shard (a resharding plan)."""

    def __init__(self, source: Any, rank: int, shards: Callable[[], Any] | None = None) -> None:
        self.source = source
        self.rank = rank
        self.shards = shards
        self._engine: Any = None
        self._group_id: str | None = None

    def send(self, order: SendOrder, client: VLLMWeightSyncClient | None) -> str | ReshardSent | None:
        """Take part in one transfer; on rank 0 the checksum of what was sent (when the engine
        reports one; a resharding transfer: each generator's). Raises when the transfer failed;
        the group is then closed."""
        if self._group_id != order.group_id:
            self.close()
            try:
                if order.reshard is not None:
                    assert self.shards is not None, "a resharding transfer needs the rank's shards"
                    self._engine = _reshard_init(order, self.rank, client or _NotTheSender(), self.shards())
                else:
                    self._engine = _trainer_init(order, self.rank, client or _NotTheSender(), self.source)
            except BaseException:
                if order.reshard is None:
                    for _ in self.source:  # the other ranks gather alongside: keep them in step, then fail
                        pass
                raise
            self._group_id = order.group_id
        try:
            # No `refit_threads` here: rank 0 casts into a bucket buffer it reuses (about 3 GiB/s of
            # bfloat16 per thread, faster than a generator loads the buckets), so more threads only
            # compete with the generators' receive where they share the host (measured: no gain).
            self._engine.send_weights()
        except BaseException:
            self.close()
            raise
        if order.reshard is not None:
            sent: ReshardSent = self._engine.sent
            return sent
        checksum: str | None = getattr(self._engine, "last_checksum", None)
        return checksum

    def close(self) -> None:
        if self._engine is not None:
            try:
                self._engine.shutdown()
            except Exception as exc:  # a broken group may fail to close; it is dropped either way
                log.warning("closing weight-transfer group %s: %s", self._group_id, exc)
        self._engine, self._group_id = None, None


def _trainer_init(order: SendOrder, rank: int, client: Any, source: Any) -> Any:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shared_torch.gloo_weights import BACKEND, GlooTrainerInitInfo, register

    register()
    info: Any
    if order.backend == BACKEND:
        info = GlooTrainerInitInfo(
            rank=rank,
            master_address=order.master_address,
            master_port=order.master_port,
            world_size=order.world_size,
            group_id=order.group_id,
            timeout_s=order.timeout_s,
            bucket_bytes=order.bucket_bytes,
        )
    elif order.backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            rank=rank,
            master_address=order.master_address,
            master_port=order.master_port,
            world_size=order.world_size,
            packed=True,
            packed_buffer_size_bytes=order.bucket_bytes,
        )
    else:
        raise ValueError(f"no trainer-side weight-transfer engine {order.backend!r} (gloo or nccl)")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _reshard_init(order: SendOrder, rank: int, client: Any, shards: Any) -> Any:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shared_torch.gloo_reshard import GlooReshardTrainerInitInfo
    from shared_torch.gloo_weights import register

    register()
    r = order.reshard
    assert r is not None
    info = GlooReshardTrainerInitInfo(
        rank=rank,
        master_address=order.master_address,
        master_port=order.master_port,
        world_size=order.world_size,
        trainer_ranks=r.trainer_ranks,
        group_id=order.group_id,
        dtype=r.dtype,
        slot_bytes=r.slot_bytes,
        slots=r.slots,
        links=r.links.get(rank, {}),
        generators=r.generators,
        workers=r.workers,
        timeout_s=order.timeout_s,
        delta=r.delta,
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=shards)

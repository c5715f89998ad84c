"""A gloo weight-transfer engine for vLLM's weight-transfer layer, both sides.

vLLM (0.32) moves weights from a trainer into running engines through
`vllm.distributed.weight_transfer`: a worker-side `WeightTransferEngine` picked by
``WeightTransferConfig(backend=...)`` and a trainer-side `TrainerWeightTransferEngine`, each from
its own registry. Its built-in engines need GPUs (NCCL, CUDA IPC). This module registers a
``gloo`` engine in both registries, so the same path (a real `AsyncLLM` receiving into its model
while serving) runs on CPU machines and in CI; on GPUs the run uses vLLM's own ``nccl`` engine.

The wire format (`shared_torch.weight_wire`: buckets of packed parameters, each followed by its
xxh3 digest, checked by the receiver before it loads) is derived from the parameter list alone.
Group members: the trainer's sending rank is rank 0, each
generator worker ``rank_offset + its rank inside its engine`` (the trainer assigns the offsets).
Every broadcast is bounded by the group's ``timeout_s``.

`register()` is idempotent; vLLM calls it in every process through the ``vllm.general_plugins``
entry point (the engine core's workers included), and importing this module runs it too (the
generator names `TransferChecksumExtension` as vLLM's worker extension, so workers import it even
where the entry point is not installed); the trainer calls it before sending.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shared_torch.group_engine import GroupEngine, form_group
from shared_torch.weight_wire import (
    DEFAULT_BUCKET_BYTES,
    Group,
    TransferError,
    bucket_buffer,
    digest,
    max_bucket_bytes,
    metas_from_update,
    nbytes,
    open_group,
    plan_buckets,
    receive_buckets,
    transfer_checksum,
    wait_all,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

log = logging.getLogger(__name__)

BACKEND = "gloo"


# ---- worker side (inside vLLM's engine) ----------------------------------------------------------


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_id: str
    timeout_s: float = 300.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )


_Engine = WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]


class GlooWeightTransferEngine(GroupEngine, _Engine):  # type: ignore[misc,valid-type]  # vLLM is untyped
    """Receives checkpoint-format weights over gloo and loads them with the model's own
    ``load_weights`` inside vLLM's layer-wise reload (as vLLM's NCCL engine does)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Group | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.last_checksum: str | None = None
        self._buffers: list[torch.Tensor] = []  # two receive buffers, kept across transfers

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        rank = init_info.rank_offset + int(self.parallel_config.rank)
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.group_id,
            init_info.timeout_s,
        )
        log.info("joined weight-transfer group %s as rank %d of %d", init_info.group_id, rank, init_info.world_size)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator; a gloo receive has finished when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise TransferError("gloo weight transfer not initialized: init_weight_transfer_engine first")
        metas = metas_from_update(update_info.names, update_info.dtype_names, update_info.shapes)
        digests: list[bytes] = []
        on_host = self.device.type == "cpu"
        try:
            # vLLM's layer-wise reload keeps the tensors it is given until their layer is complete,
            # so they must outlive the bucket: on CPU each bucket lands in memory of its own that
            # the model may keep (a copy of every tensor out of a reused buffer was a whole extra
            # pass over the model); elsewhere the copy is the move onto the device anyway.
            for pairs, got in receive_buckets(self.group, metas, self.bucket_bytes, self._buffers, keep=on_host):
                self.model.load_weights(pairs if on_host else [(n, t.to(self.device, copy=True)) for n, t in pairs])
                digests.append(got)
        except Exception:
            self.shutdown()  # the group is unusable after a failed collective
            raise
        self.last_checksum = transfer_checksum(digests)


# ---- trainer side --------------------------------------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    """Trainer-side init info; ``world_size`` counts the sender (rank 0) and every generator worker."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    group_id: str
    timeout_s: float = 300.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):  # type: ignore[misc]
    """Rank 0 opens the group and broadcasts bucket by bucket while the source gathers; the other
    trainer ranks only iterate the source (their part of each FSDP gather)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        init_info: GlooTrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.group: Group | None = None
        self.last_checksum: str | None = None
        self._buffers: list[torch.Tensor] = []  # two send buffers, kept across transfers

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("the gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,  # the client gives each generator its own offset
            world_size=init_info.world_size,
            group_id=init_info.group_id,
            timeout_s=init_info.timeout_s,
            bucket_bytes=init_info.bucket_bytes,
        )
        engine.group = form_group(
            lambda: open_group(
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                init_info.group_id,
                init_info.timeout_s,
            ),
            lambda: client.init_weight_transfer_engine(asdict(worker_info)),
            init_info.group_id,
        )
        return engine

    def send_weights(self) -> None:
        assert self.source is not None and self.init_info is not None
        metas = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        update = GlooWeightTransferUpdateInfo(
            names=[m.name for m in metas],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in metas],
            shapes=[list(m.shape) for m in metas],
        )
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(update))
            self._broadcast(metas)
            future.result()
        finally:
            exe.shutdown(wait=False)  # a worker stuck in a broken group must not hang the trainer
        self.client.finish_weight_update()

    def _broadcast(self, metas: list[ParamMeta]) -> None:
        """Copy each tensor, as it arrives, into its place in a bucket buffer (casting to the wire
        dtype on the way), then post the full bucket's broadcast, and its digest once hashed,
        without waiting: two buffers alternate, so the next bucket is packed while this one
        travels (and the generators load the last one). A source that offers ``iter_uncast``
        yields its tensors before the cast, so the cast is this copy and no tensor-sized temporary
        is made. After a failure the source is still drained, so trainer ranks gathering alongside
        stay in step; then the failure is raised."""
        assert self.source is not None and self.init_info is not None
        buckets = plan_buckets(metas, self.init_info.bucket_bytes)
        ends = {idx[-1]: b for b, idx in enumerate(buckets)}
        starts = {idx[0]: b for b, idx in enumerate(buckets)}
        sizes = [nbytes(m.dtype, m.shape) for m in metas]
        need = max_bucket_bytes(metas, self.init_info.bucket_bytes)
        self._buffers = [bucket_buffer(b, need) for b in (self._buffers or [None, None])]
        stream = getattr(self.source, "iter_uncast", None)
        pairs = stream() if callable(stream) else iter(self.source)
        digests: list[bytes] = []
        in_flight: dict[int, list[Any]] = {}  # bucket -> its posted works
        failure: BaseException | None = None
        offset = 0
        for i, (name, tensor) in enumerate(pairs):
            if i >= len(metas) or name != metas[i].name or tuple(tensor.shape) != metas[i].shape:
                failure = failure or TransferError(f"the weight source yielded {name!r} out of its metadata order")
                continue
            if failure is not None:
                continue
            try:
                if i in starts:  # this bucket's buffer was the one before last's: wait until it left
                    wait_all(in_flight.pop(starts[i] - 2, []))
                k = starts.get(i, len(digests))
                buf = self._buffers[k % 2]
                m = metas[i]
                buf[offset : offset + sizes[i]].view(m.dtype).view(m.shape).copy_(tensor.detach())
                offset += sizes[i]
                if i not in ends:
                    continue
                full, offset = buf[:offset], 0
                group = self._require_group()
                # The bucket leaves first and is hashed while it travels (both only read it); its
                # digest follows it. Posted works live only in in_flight (see wait_all).
                in_flight[ends[i]] = [group.start_broadcast(full)]
                d = digest(full)
                in_flight[ends[i]].append(group.start_broadcast(torch.frombuffer(bytearray(d), dtype=torch.uint8)))
                digests.append(d)
            except Exception as exc:  # a peer died or timed out: stop sending, keep draining
                failure = exc
                in_flight.clear()
                self.shutdown()
        try:
            while in_flight:
                wait_all(in_flight.pop(min(in_flight)))
        except Exception as exc:
            failure = failure or exc
            in_flight.clear()
            self.shutdown()
        if failure is not None:
            raise TransferError(f"weight broadcast failed: {failure}") from failure
        if len(digests) != len(buckets):
            raise TransferError(f"the weight source yielded {len(digests)} of {len(buckets)} buckets")
        self.last_checksum = transfer_checksum(digests)

    def _require_group(self) -> Group:
        if self.group is None:
            raise TransferError("the weight-transfer group is closed")
        return self.group

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def transfer_backend(configured: str, method: str = "broadcast") -> str:
    """The vLLM weight-transfer engine ``refit.collective.backend`` and ``method`` name (backend
    auto: nccl on GPUs, gloo elsewhere; method auto: ``gloo_reshard`` over gloo, where it is
    built, a broadcast over nccl)."""
    backend = configured if configured != "auto" else ("nccl" if torch.cuda.is_available() else BACKEND)
    reshard_built = backend == BACKEND
    if method == "reshard" and not reshard_built:
        raise ValueError(f"refit.collective.method reshard runs over gloo, not {backend}")
    if method != "broadcast" and reshard_built:
        from shared_torch.gloo_reshard import BACKEND as RESHARD

        return RESHARD
    return backend


class TransferChecksumExtension:
    """Mixed into vLLM's workers (``worker_extension_cls``): the checksum of the last transfer a
    worker received, for ``collective_rpc("streamrl_transfer_checksum")``. Importing this module
    in the worker also registers the gloo engine there."""

    def streamrl_transfer_checksum(self) -> str | None:
        engine = getattr(self, "weight_transfer_engine", None)
        checksum: str | None = getattr(engine, "last_checksum", None)
        return checksum


EXTENSION = f"{__name__}.TransferChecksumExtension"


def register() -> None:
    """Register the ``gloo`` engines with vLLM's factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
    from shared_torch import gloo_reshard

    gloo_reshard.register()


register()

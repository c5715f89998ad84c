"""A refit without a gather over gloo, as vLLM weight-transfer engines (``gloo_reshard``), both sides.

Every trainer rank sends the boxes of its own shard that each engine rank keeps, straight to that
engine rank, all links at once (`shared_torch.reshard_wire`); nobody gathers a whole tensor.
What goes where is the resharding plan's (`services.trainer.reshard_plan`), made on the trainer's
rank 0 when a transfer group forms and handed out then: each trainer rank gets its links in its
init info, each engine rank its own in the generator's (``receives``, one entry per engine rank).

Group ranks: the trainer's ranks are ``0 .. trainer_ranks - 1`` (rank 0 hosts the rendezvous);
each generator's engine ranks follow at ``rank_offset + its rank inside its engine``. After each
transfer every trainer rank posts its links' checksums (or its error) on the group's store; rank 0
reads them all and works out the checksum each generator's ack must carry (`expected`), so a
transfer one trainer rank failed fails on rank 0 too, naming the rank.

An engine rank writes each received box into the published tensor it belongs to and, once the
tensor is complete, loads it with the model's own ``load_weights`` inside vLLM's layer-wise reload:
its weight loaders keep exactly the boxes the plan sent (the plan was made from those loaders,
`shared_torch.engine_reads`). `register()` is called by `shared_torch.gloo_weights.register`.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shared.boxes import volume
from shared_torch.group_engine import GroupEngine, form_group
from shared_torch.reshard_delta import DeltaState
from shared_torch.reshard_wire import (
    Links,
    ReshardSent,
    decode_links,
    engine_checksum,
    rank_checksum,
    receive_links,
    send_links,
    slot_buffers,
)
from shared_torch.weight_wire import Group, TransferError, open_group

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

log = logging.getLogger(__name__)

BACKEND = "gloo_reshard"


@dataclass
class GlooReshardInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_id: str
    dtype: str
    slot_bytes: int
    shapes: dict[str, list[int]]
    receives: list[list[Any]]  # per engine rank: its links (`reshard_wire.encode_links`)
    timeout_s: float = 300.0
    delta: bool = False  # changed bytes only (`shared_torch.reshard_delta`)


@dataclass
class GlooReshardUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    version: int = -1


class GlooReshardEngine(GroupEngine, WeightTransferEngine[GlooReshardInitInfo, GlooReshardUpdateInfo]):  # type: ignore[misc]
    """One engine rank's side: its links received at once, each tensor loaded once complete."""

    init_info_cls = GlooReshardInitInfo
    update_info_cls = GlooReshardUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Group | None = None
        self.info: GlooReshardInitInfo | None = None
        self.links: Links = {}
        self.last_checksum: str | None = None
        self.delta: DeltaState | None = None

    def init_transfer_engine(self, init_info: GlooReshardInitInfo) -> None:
        self.shutdown()
        engine_rank = int(self.parallel_config.rank)
        self.info = init_info
        self.links = decode_links(init_info.receives[engine_rank])
        self.delta = DeltaState() if init_info.delta else None  # a new group starts from whole payloads
        rank = init_info.rank_offset + engine_rank
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.group_id,
            init_info.timeout_s,
        )
        log.info(
            "joined weight-transfer group %s as rank %d of %d (%d links)",
            init_info.group_id,
            rank,
            init_info.world_size,
            len(self.links),
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooReshardUpdateInfo) -> None:
        if self.group is None or self.info is None:
            raise TransferError("gloo reshard transfer not initialized: init_weight_transfer_engine first")
        on_host = self.device.type == "cpu"

        def take(name: str, tensor: torch.Tensor) -> None:
            self.model.load_weights([(name, tensor if on_host else tensor.to(self.device))])

        try:
            self.last_checksum = receive_links(
                self.group,
                self.links,
                {n: tuple(s) for n, s in self.info.shapes.items()},
                getattr(torch, self.info.dtype),
                self.info.slot_bytes,
                take,
                self.delta,
            )
        except Exception:
            self.shutdown()
            raise


# ---- trainer side --------------------------------------------------------------------------------


@dataclass
class GlooReshardTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    """One trainer rank's part of a transfer group: its links, and (rank 0) the generators' init."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    trainer_ranks: int
    group_id: str
    dtype: str
    slot_bytes: int
    slots: int
    links: Links
    generators: dict[str, list[int]] = field(default_factory=dict)  # worker -> its engine ranks' group ranks
    workers: dict[str, Any] = field(default_factory=dict)  # the generators' init info (rank 0)
    timeout_s: float = 300.0
    delta: bool = False


class GlooReshardTrainerEngine(TrainerWeightTransferEngine[GlooReshardTrainerInitInfo]):  # type: ignore[misc]
    """Every trainer rank is a sender. ``source`` prepares and reads this rank's boxes
    (`services.trainer.reshard_source.FsdpShards`: ``prepare(pieces)``, ``reader()``)."""

    init_info_cls = GlooReshardTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: Any, is_sender: bool, init_info: GlooReshardTrainerInitInfo
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.group: Group | None = None
        self.transfers = 0
        self.sent: Any = None  # rank 0: `weight_send.ReshardSent` of the last transfer
        self.delta = DeltaState() if init_info.delta else None
        self._slots: list[torch.Tensor] = []

    @classmethod
    def trainer_init(
        cls, init_info: GlooReshardTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Any = None
    ) -> Self:
        if source is None:
            raise ValueError("the gloo reshard trainer engine needs this rank's shards as its source")
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0, init_info=init_info)
        source.prepare(piece for buckets in init_info.links.values() for bucket in buckets for piece in bucket)

        def open_() -> Group:
            return open_group(
                init_info.master_address,
                init_info.master_port,
                init_info.rank,
                init_info.world_size,
                init_info.group_id,
                init_info.timeout_s,
            )

        if init_info.rank != 0:
            engine.group = open_()
            return engine
        engine.group = form_group(
            open_, lambda: client.init_weight_transfer_engine(init_info.workers), init_info.group_id
        )
        return engine

    def send_weights(self) -> None:
        info = self.init_info
        if self.group is None:
            raise TransferError("the weight-transfer group is closed")
        self.transfers += 1
        dtype = getattr(torch, info.dtype)
        if self.is_sender:
            self.client.start_weight_update()
            exe = ThreadPoolExecutor(max_workers=1)
            future = exe.submit(self.client.update_weights, asdict(GlooReshardUpdateInfo(version=self.transfers)))
        report: dict[str, Any]
        try:
            self._slots = slot_buffers(self._slots, info.slots, info.slot_bytes)
            if self.delta is not None:
                self.delta.start()
            sums = send_links(self.group, info.links, self.source.reader(), dtype, self._slots, self.delta)
            report = {"sums": {str(k): v for k, v in sums.items()}, **self._figures(dtype)}
        except Exception as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"}
        self._post(report)
        if not self.is_sender:
            if "error" in report:
                self.shutdown()
                raise TransferError(report["error"])
            return
        try:
            future.result()
        finally:
            exe.shutdown(wait=False)
        self.sent = self._gather()
        self.client.finish_weight_update()

    def _figures(self, dtype: torch.dtype) -> dict[str, int]:
        """This rank's elements, changed elements and wire bytes of the transfer just sent."""
        if self.delta is not None:
            return {"elements": self.delta.elements, "changed": self.delta.changed, "wire": self.delta.wire_bytes}
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = sum(volume(box) for buckets in self.init_info.links.values() for b in buckets for _, box in b)
        return {"elements": n, "changed": n, "wire": n * itemsize}

    def _post(self, report: dict[str, Any]) -> None:
        assert self.group is not None
        try:
            self.group.store.set(
                f"{self.init_info.group_id}/sent/{self.transfers}/{self.init_info.rank}", json.dumps(report)
            )
        except Exception as exc:  # rank 0 then times out waiting for this rank's report, naming it
            log.warning("could not report transfer %d: %s", self.transfers, exc)

    def _gather(self) -> Any:
        """Every trainer rank's report of this transfer: the checksum each generator must ack, and
        the transfer's figures (`weight_send.ReshardSent`)."""
        assert self.group is not None
        info = self.init_info
        link_sums: dict[int, dict[int, str]] = {}  # engine group rank -> trainer rank -> checksum
        errors = []
        figures = {"elements": 0, "changed": 0, "wire": 0}
        for r in range(info.trainer_ranks):
            try:
                raw = self.group.store.get(f"{info.group_id}/sent/{self.transfers}/{r}")
            except Exception as exc:
                errors.append(f"trainer rank {r} did not report its sends: {exc}")
                continue
            report = json.loads(raw)
            if "error" in report:
                errors.append(f"trainer rank {r}: {report['error']}")
                continue
            for dest, checksum in report["sums"].items():
                link_sums.setdefault(int(dest), {})[r] = checksum
            for key in figures:
                figures[key] += int(report[key])
        if errors:
            self.shutdown()
            raise TransferError("; ".join(errors))
        checksums = {
            worker: engine_checksum([rank_checksum(link_sums.get(g, {})) for g in ranks])
            for worker, ranks in info.generators.items()
        }
        return ReshardSent(checksums, figures["elements"], figures["changed"], figures["wire"])

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def register() -> None:
    """Register the ``gloo_reshard`` engines with vLLM's factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooReshardEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooReshardTrainerEngine)

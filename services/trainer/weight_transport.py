"""How a weight version's bytes reach the generators: the `WeightTransport` extension point.

The refit (`services.trainer.refit.WeightPublisher`) owns everything around it: close the launch
gate, pick the generators, ask the transport to move the version, wait for every generator's ack,
reopen the gate. A transport moves the bytes, announces on the weights stream what generators need
to take them, and says what their acks must carry::

    filesystem  every trainer rank writes its own files of a safetensors folder, digests computed
                while writing -> announce the path and each file's digest -> every generator
                verifies its files in parallel and loads the folder
    collective  vLLM's weight-transfer engines: announce the transfer group when the membership
                changed (generators join while rank 0 opens it), then the version's parameter
                list -> rank 0 broadcasts bucket by bucket while the trainer's ranks gather,
                generators receive straight into their engines -> each ack carries the checksum
                of what it received, which must equal what was sent

Picked by ``refit.transport`` (`build_transport`). A transfer that fails raises `TransferFailed`;
the publisher then works out which generators were lost, and retries without them (a fresh group).
With the collective transport the trainer also writes the published version to disk every
``refit.collective.snapshot_period`` steps (off the gate), for generators that start mid-run.
Every transport passes the contract in tests/integration/test_weight_transport.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shared.netaddr import advertise_address
from shared.protocol import CollectiveOrder, WeightAnnouncement, WeightSnapshot, WeightTransportName, encode
from shared.weights_format import dir_num_bytes, folder_digests, manifest_checksum
from shared_torch.reshard_wire import ReshardSent
from shared_torch.weight_wire import nbytes

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from services.trainer.learner import Learner
    from services.trainer.reshard_order import EngineNeeds
    from services.trainer.reshard_plan import Holdings
    from services.trainer.weight_send import SendOrder
    from shared.keys import RunKeys
    from shared.run_config import RunConfig

log = logging.getLogger(__name__)

Announce = Callable[[WeightAnnouncement], Coroutine[Any, Any, None]]
# Writes the policy into a folder; the digest of each file it wrote (None: compute them after).
Export = Callable[[Path], "dict[str, str] | None"]


class TransferFailed(RuntimeError):
    """The bytes of a version did not reach every generator (one died or failed mid-transfer)."""


@dataclass
class Sent:
    move_s: float  # writing the folder, or the whole transfer
    num_bytes: int
    checksum: str | None = None  # what every generator's ack must report (collective transfers)
    group: str | None = None  # the transfer group acks must name (collective transfers)
    checksums: dict[str, str] | None = None  # what each generator's ack must report (resharding transfers)
    changed_fraction: float | None = None  # resharding transfers: elements changed since the engines' version


class WeightTransport(Protocol):
    name: WeightTransportName

    async def send(self, version: int, members: list[str], announce: Announce) -> Sent:
        """Move ``version`` to the generators ``members`` (announcing what they need); returns
        once the bytes are on their way or there. Raises `TransferFailed` when they did not arrive."""
        ...

    async def after_confirmed(self, version: int) -> None:
        """Every generator confirmed ``version`` and the gate is open again: housekeeping."""
        ...

    def forget(self) -> None:
        """Drop any state tied to the last membership (the next send starts afresh)."""
        ...

    async def aclose(self) -> None:
        """Wait for housekeeping still running in the background (the trainer is stopping)."""
        ...


class FilesystemTransport:
    """A safetensors folder per version under ``weights_dir`` (written to a temporary name, then
    renamed); the newest ``keep_versions`` are kept. Older ones are removed in the background once
    a version is confirmed (unlinking a folder frees its page-cache pages: work the refit need not
    wait for); the next write, and `aclose`, wait until that removal is done."""

    name: WeightTransportName = "filesystem"

    def __init__(self, weights_dir: Path, export: Export, *, keep_versions: int = 3) -> None:
        self.weights_dir = Path(weights_dir)
        self.export = export
        self.keep_versions = keep_versions
        self._pruning: asyncio.Task[None] | None = None

    async def send(self, version: int, members: list[str], announce: Announce) -> Sent:
        await self.pruned()
        t0 = time.perf_counter()
        path, files = await asyncio.to_thread(self.write, version)
        num_bytes = dir_num_bytes(path)
        move_s = time.perf_counter() - t0
        await announce(
            WeightAnnouncement(
                version=version,
                path=str(path.resolve()),
                checksum=manifest_checksum(files),
                files=files,
                num_bytes=num_bytes,
                transport="filesystem",
            )
        )
        return Sent(move_s, num_bytes)

    def write(self, version: int) -> tuple[Path, dict[str, str]]:
        """The folder of ``version`` and its files' digests."""
        final = self.weights_dir / f"v{version:06d}"
        tmp = self.weights_dir / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files = self.export(tmp) or folder_digests(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final, files

    async def after_confirmed(self, version: int) -> None:
        await self.pruned()
        self._pruning = asyncio.create_task(asyncio.to_thread(self.prune), name="weights-prune")

    async def pruned(self) -> None:
        """Wait until the versions beyond ``keep_versions`` are removed (a no-op when no removal
        runs). The removal ignores errors, so this only waits."""
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            await pruning

    async def aclose(self) -> None:
        await self.pruned()

    def prune(self) -> None:
        versions = sorted(p for p in self.weights_dir.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)

    def forget(self) -> None:
        return None


class _GroupClient:
    """vLLM's `VLLMWeightSyncClient` for a trainer engine, over the run's weights stream: the
    generator-side calls become announcements every member acts on (`services.generator.weights`).
    It lives as long as its transfer group; `bind` points it at the version being sent."""

    def __init__(self, group_id: str, backend: str, ranks: dict[str, int], timeout_s: float) -> None:
        self.group_id = group_id
        self.backend = backend
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.num_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._announce: Announce | None = None
        self._version = -1
        self._init_info: dict[str, Any] = {}

    def bind(self, loop: asyncio.AbstractEventLoop, announce: Announce, version: int) -> None:
        self._loop, self._announce, self._version = loop, announce, version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._init_info = dict(init_info)
        self._publish(
            CollectiveOrder(group_id=self.group_id, backend=self.backend, init_info=self._init_info, ranks=self.ranks)
        )

    def start_weight_update(self) -> None:
        return None  # each generator starts its update when the version's announcement reaches it

    def update_weights(self, update_info: Any) -> None:
        if not isinstance(update_info, dict):
            raise TypeError("one update per version: update_info must be a dict")
        self.num_bytes = sum(
            nbytes(d, s) for d, s in zip(update_info.get("dtype_names", []), update_info.get("shapes", []), strict=True)
        )
        self._publish(
            CollectiveOrder(
                group_id=self.group_id,
                backend=self.backend,
                init_info=self._init_info,
                ranks=self.ranks,
                update_info=update_info,
            )
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        return None  # each generator finishes, checks and acks on its own

    def _publish(self, order: CollectiveOrder) -> None:
        assert self._loop is not None and self._announce is not None, "bind() first"
        ann = WeightAnnouncement(version=self._version, transport="collective", collective=order)
        asyncio.run_coroutine_threadsafe(self._announce(ann), self._loop).result(timeout=self.timeout_s)


@dataclass
class _Group:
    members: list[str]
    order: SendOrder
    client: _GroupClient


class CollectiveTransport:
    """vLLM's weight-transfer engines, driven through the learner (every trainer rank takes part)."""

    name: WeightTransportName = "collective"

    def __init__(
        self,
        learner: Learner,
        *,
        backend: str,
        master_address: str,
        bucket_bytes: int,
        timeout_s: float,
        workers_per_generator: int,
        snapshots: FilesystemTransport,
        snapshot_period: int,
        redis: Redis,
        keys: RunKeys,
        engine_needs: EngineNeeds | None = None,
        delta: bool = False,
    ) -> None:
        self.learner = learner
        self.backend = backend
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.workers_per_generator = workers_per_generator
        self.snapshots = snapshots
        self.snapshot_period = max(1, snapshot_period)
        self.redis = redis
        self.keys = keys
        self.engine_needs = engine_needs  # set: transfers follow a resharding plan
        self.delta = delta
        self.groups_formed = 0
        self._holdings: Holdings | None = None
        self._group: _Group | None = None
        self._last_snapshot: int | None = None

    async def send(self, version: int, members: list[str], announce: Announce) -> Sent:
        if self._group is None or self._group.members != members:
            self._group = await asyncio.to_thread(self._new_group, members)
        group = self._group
        group.client.bind(asyncio.get_running_loop(), announce, version)
        t0 = time.perf_counter()
        try:
            checksum = await asyncio.to_thread(self.learner.send_weights, group.order, group.client)
        except Exception as exc:
            self.forget()
            raise TransferFailed(f"{type(exc).__name__}: {exc}") from exc
        move_s = time.perf_counter() - t0
        if isinstance(checksum, ReshardSent):
            changed = checksum.changed / max(1, checksum.elements)
            return Sent(
                move_s,
                checksum.wire_bytes,
                checksums=checksum.checksums,
                group=group.order.group_id,
                changed_fraction=changed,
            )
        return Sent(move_s, group.client.num_bytes, checksum, group.order.group_id)

    def _new_group(self, members: list[str]) -> _Group:
        from services.trainer.weight_send import SendOrder

        self.groups_formed += 1
        group_id = f"g{self.groups_formed}-{secrets.token_hex(4)}"
        if self.engine_needs is not None:
            return self._new_reshard_group(group_id, members)
        ranks = {m: 1 + i * self.workers_per_generator for i, m in enumerate(members)}
        order = SendOrder(
            group_id=group_id,
            backend=self.backend,
            master_address=self.master_address,
            master_port=_free_port(),
            world_size=1 + len(members) * self.workers_per_generator,
            timeout_s=self.timeout_s,
            bucket_bytes=self.bucket_bytes,
        )
        log.info("weight-transfer group %s: %d generator(s), world size %d", group_id, len(members), order.world_size)
        return _Group(list(members), order, _GroupClient(group_id, self.backend, ranks, self.timeout_s))

    def _new_reshard_group(self, group_id: str, members: list[str]) -> _Group:
        """A group whose transfers follow a resharding plan to ``members`` (`reshard_order`)."""
        from services.trainer.reshard_order import reshard_order
        from services.trainer.weight_send import SendOrder

        engine = self.engine_needs
        assert engine is not None
        backend = self.learner.backend
        if self._holdings is None:
            shards = backend.weight_shards()
            self._holdings = shards.holdings()
            engine.shapes = dict(shards.shapes)
        trainer_ranks = backend.layout.world.world_size
        world_size = trainer_ranks + len(members) * engine.ranks
        port = _free_port()
        dtype = str(backend.dtype).removeprefix("torch.")
        info = {
            "master_address": self.master_address,
            "master_port": port,
            "world_size": world_size,
            "group_id": group_id,
            "timeout_s": self.timeout_s,
        }
        reshard, _ = reshard_order(
            self._holdings,
            engine,
            members,
            trainer_ranks=trainer_ranks,
            dtype=dtype,
            itemsize=backend.dtype.itemsize,
            bucket_bytes=self.bucket_bytes,
            generator_info=info,
            delta=self.delta,
        )
        order = SendOrder(
            group_id=group_id,
            backend=self.backend,
            master_address=self.master_address,
            master_port=port,
            world_size=world_size,
            timeout_s=self.timeout_s,
            bucket_bytes=self.bucket_bytes,
            reshard=reshard,
        )
        ranks = {m: trainer_ranks + i * engine.ranks for i, m in enumerate(members)}
        log.info(
            "weight-transfer group %s: %d trainer rank(s) resharding into %d generator(s), world size %d",
            group_id,
            trainer_ranks,
            len(members),
            world_size,
        )
        return _Group(list(members), order, _GroupClient(group_id, self.backend, ranks, self.timeout_s))

    async def after_confirmed(self, version: int) -> None:
        if self._last_snapshot is not None and version - self._last_snapshot < self.snapshot_period:
            return
        t0 = time.perf_counter()
        path, files = await asyncio.to_thread(self.snapshots.write, version)
        snapshot = WeightSnapshot(
            version=version,
            path=str(path.resolve()),
            checksum=manifest_checksum(files),
            files=files,
            num_bytes=dir_num_bytes(path),
        )
        await self.redis.set(self.keys.weights_snapshot, encode(snapshot))
        self._last_snapshot = version
        await asyncio.to_thread(self.snapshots.prune)
        log.info(
            "weight version %d written to disk for generators that start later (%.2fs)",
            version,
            time.perf_counter() - t0,
        )

    def forget(self) -> None:
        self._group = None

    async def aclose(self) -> None:
        await self.snapshots.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def build_transport(
    cfg: RunConfig, learner: Learner, weights_dir: Path, redis: Redis, keys: RunKeys
) -> WeightTransport:
    """The transport ``refit.transport`` names."""
    files = FilesystemTransport(weights_dir, learner.export_weights)
    if cfg.refit.transport == "filesystem":
        return files
    from shared_torch.gloo_reshard import BACKEND as RESHARD
    from shared_torch.gloo_weights import transfer_backend

    c = cfg.refit.collective
    v = cfg.policy.generation.vllm_cfg
    backend = transfer_backend(c.backend, c.method)
    needs = None
    if backend == RESHARD:
        from services.trainer.reshard_order import EngineNeeds

        needs = EngineNeeds(
            cfg.policy.model_name,
            engine=cfg.policy.generation.backend,
            tensor_parallel_size=v.tensor_parallel_size,
            expert_parallel=v.enable_expert_parallel,
        )
    return CollectiveTransport(
        learner,
        backend=backend,
        master_address=c.master_address or advertise_address(cfg.redis.url),
        bucket_bytes=c.bucket_mb << 20,
        timeout_s=cfg.trainer.refit_timeout_s,
        workers_per_generator=v.tensor_parallel_size,
        snapshots=files,
        snapshot_period=c.snapshot_period or cfg.checkpointing.save_period,
        redis=redis,
        keys=keys,
        engine_needs=needs,
        delta=c.delta,
    )

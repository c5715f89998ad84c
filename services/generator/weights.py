"""Weight versions: follow the run's ``weights`` stream, load each new version, acknowledge it.

One code path for every load (the watcher and ``POST /admin/load_weights`` both call
`WeightSync.apply`). For an announcement newer than the served version, by its transport::

    filesystem: pause (close the gate; drain up to generator.drain_timeout_s, or keep) while
                every file's digest is verified (in parallel) --> load the folder in place
    collective: pause --> receive over the transfer group (vLLM's start_weight_update,
                update_weights, finish_weight_update) --> the engine's own checksums
      --> reset the prefix cache if caching is effectively on (False = failure)
      --> set weight_version --> resume (open the gate) --> WeightAck(ok, cache_reset, load_s, checksums)

A collective announcement without ``update_info`` asks this generator to join a new transfer
group (the trainer opens it meanwhile); it is acknowledged only when joining fails. A generator
that starts while the run's versions move collectively loads the newest snapshot on disk
(``weights:snapshot``) and joins the group at the next refit. An engine that started on random
weights (``load_format: dummy``) keeps the generator ``awaiting_weights`` (no generation) until
its first version loads here.

Checksum, load and reset share the ``generator.weight_load_timeout_s`` deadline. Any failure
marks the generator failed (503 for generation, heartbeat state "failed") and is acked with
ok=False and the error; a later successful load clears it. Re-announcing the version being served
with the same checksum is acked ok without reloading. An *older* version is loaded: only a
trainer that resumed from an earlier checkpoint announces one, and the versions this generator
served after it belong to the abandoned run (a rollback, logged). So is the same version with
other weights.

At startup the newest announcement (if any) is loaded before the generator reports ready; the
watcher then reads entries after it with blocking reads, so nothing published in between is
missed. Started by the app's bring-up task as a supervised task: a watcher that dies fails the
service (`shared.service.ServiceLifecycle`), which then exits with code 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from services.generator.engine import PauseMode
from services.generator.metrics import GeneratorMetrics
from services.generator.runtime import LocalPause, Runtime
from shared import keys as K
from shared.protocol import (
    CollectiveOrder,
    ProtocolError,
    WeightAck,
    WeightAnnouncement,
    WeightSnapshot,
    WeightTransportName,
    decode,
)
from shared.redis_replies import as_text, range_entries
from shared.streams import StreamClient
from shared.weights_format import checksum_dir, safetensors_files, verify_files

log = logging.getLogger(__name__)

_BLOCK_MS = 1000
_RETRY_S = 1.0


class RefitError(RuntimeError):
    """A weight version could not be put into service."""


@dataclass(frozen=True)
class LoadOrder:
    """What to load: from an announcement, a snapshot or the admin route."""

    version: int
    path: str
    checksum: str | None
    mode: PauseMode = "drain"
    transport: WeightTransportName = "filesystem"
    files: dict[str, str] | None = None  # file -> digest; None: check ``checksum`` over the folder
    collective: CollectiveOrder | None = None
    probe: list[int] | None = None  # token ids to score once the version serves


class WeightSync:
    """Applies weight versions to the engine and acknowledges them on the ``weight_acks`` stream."""

    def __init__(
        self,
        runtime: Runtime,
        metrics: GeneratorMetrics,
        streams: StreamClient | None,
        *,
        load_timeout_s: float,
        block_ms: int = _BLOCK_MS,
    ) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.streams = streams
        self.load_timeout_s = load_timeout_s
        self.block_ms = block_ms
        self._lock = asyncio.Lock()
        self._stopping = False

    async def apply(self, order: LoadOrder) -> WeightAck:
        """Load ``order`` unless it is not newer, publish the ack (when streams exist), return it."""
        ack = await self._apply(order)
        await self._publish(ack)
        return ack

    async def join(self, order: CollectiveOrder, version: int) -> None:
        """Join the transfer group ``order`` names; a failure is acked (the trainer names us)."""
        rank = order.ranks.get(self.runtime.worker_id)
        if rank is None:
            return
        async with self._lock:
            try:
                async with asyncio.timeout(self.load_timeout_s):
                    await self.runtime.engine.join_weight_group(_own_init_info(order, self.runtime.worker_id, rank))
            except Exception as exc:
                error = f"could not join weight-transfer group {order.group_id}: {type(exc).__name__}: {exc}"
                log.error("%s", error)
                ack = WeightAck(
                    worker_id=self.runtime.worker_id, version=version, ok=False, error=error, group=order.group_id
                )
                await self._publish(ack)
                return
        log.info("joined weight-transfer group %s (rank %d)", order.group_id, rank)

    async def _publish(self, ack: WeightAck) -> None:
        if self.streams is None:
            return
        try:
            await self.streams.publish(self.streams.keys.weight_acks, ack, maxlen=K.WEIGHT_ACKS_MAXLEN)
        except (RedisError, OSError) as exc:
            # The client already retried with backoff; the trainer's refit deadline reports it.
            log.error("could not publish the ack of weight version %d: %s", ack.version, exc)

    async def _apply(self, order: LoadOrder) -> WeightAck:
        rt = self.runtime
        group = order.collective.group_id if order.collective is not None else None
        async with self._lock:
            same_weights = order.checksum is None or order.checksum == rt.weight_checksum
            reusable = order.transport == "filesystem" and same_weights and rt.error is None
            if order.version == rt.weight_version and reusable:
                log.info("weight version %d is already served: acked without reloading", order.version)
                return WeightAck(worker_id=rt.worker_id, version=order.version, ok=True)
            if order.version < rt.weight_version:
                log.warning(
                    "rolling back from weight version %d to %d (the trainer resumed from an earlier checkpoint)",
                    rt.weight_version,
                    order.version,
                )
            t0 = time.monotonic()
            try:
                cache_reset, received, engine_checksum = await self._load(order)
            except Exception as exc:
                source = order.path if order.transport == "filesystem" else "the transfer group"
                error = f"weight version {order.version} from {source}: {type(exc).__name__}: {exc}"
                rt.fail(error)
                self.metrics.refits.labels("failed").inc()
                return WeightAck(
                    worker_id=rt.worker_id,
                    version=order.version,
                    ok=False,
                    error=error,
                    load_s=time.monotonic() - t0,
                    group=group,
                )
            load_s = time.monotonic() - t0
            probe_logprobs = None
            if order.probe:
                try:
                    async with asyncio.timeout(self.load_timeout_s):
                        probe_logprobs = await rt.engine.score(order.probe)
                except Exception as exc:
                    error = f"scoring the probe at weight version {order.version}: {type(exc).__name__}: {exc}"
                    log.error("%s", error)
                    return WeightAck(worker_id=rt.worker_id, version=order.version, ok=False, error=error, group=group)
            rt.last_refit_s = load_s
            self.metrics.refits.labels("ok").inc()
            self.metrics.refit_seconds.observe(load_s)
            log.info("serving weight version %d (%.2fs, prefix cache reset: %s)", order.version, load_s, cache_reset)
            return WeightAck(
                worker_id=rt.worker_id,
                version=order.version,
                ok=True,
                cache_reset=cache_reset,
                load_s=load_s,
                checksum=received,
                engine_checksum=engine_checksum,
                group=group,
                probe_logprobs=probe_logprobs,
            )

    async def _load(self, order: LoadOrder) -> tuple[bool, str | None, str | None]:
        """Pause, load, reset, bump the version, resume. Whether the prefix cache was reset, and
        after a collective transfer the received weights' checksum and the engine's own. A
        folder's digests are checked while the engine pauses (drains), and before anything loads."""
        rt, engine = self.runtime, self.runtime.engine
        verifying = asyncio.create_task(self._verify(order)) if order.transport == "filesystem" else None
        received = engine_checksum = None
        try:
            await rt.pause(LocalPause.REFIT, order.mode)
            if verifying is not None:
                async with asyncio.timeout(self.load_timeout_s):
                    await verifying
            async with asyncio.timeout(self.load_timeout_s):
                if order.collective is not None:
                    if order.collective.update_info is None:
                        raise RefitError("a collective order without update_info carries no weights")
                    received = await engine.receive_weights(order.collective.update_info)
                    engine_checksum = await engine.weight_checksum()
                else:
                    await engine.load_weights(order.path)
                cache_reset = False
                if engine.prefix_caching_enabled:
                    cache_reset = await engine.reset_prefix_cache()
                    if not cache_reset:
                        raise RefitError(
                            "the engine refused to reset its prefix cache; refusing to sample against stale KV"
                        )
                    rt.prefix_cache_resets += 1
                    self.metrics.prefix_cache_resets.inc()
            rt.weight_version = order.version
            rt.awaiting_weights = False
            rt.weight_checksum = order.checksum if order.transport == "filesystem" else received
            rt.error = None
            return cache_reset, received, engine_checksum
        finally:
            if verifying is not None and not verifying.done():
                verifying.cancel()  # the pause failed: nothing loads (a hashing thread ends on its own)
            elif verifying is not None and not verifying.cancelled():
                verifying.exception()  # retrieved: a failed check was raised above, or the pause failed first
            await rt.resume(LocalPause.REFIT)

    async def _verify(self, order: LoadOrder) -> None:
        if order.files:
            await asyncio.to_thread(verify_files, order.path, order.files)
            return
        if order.checksum is None:
            await asyncio.to_thread(safetensors_files, order.path)
            log.warning("weight version %d has no checksum; loading unverified", order.version)
            return
        actual = await asyncio.to_thread(checksum_dir, order.path)
        if actual != order.checksum:
            raise RefitError(f"checksum mismatch: announced {order.checksum}, folder has {actual}")

    # -- the watcher ---------------------------------------------------------------------------

    async def load_initial(self) -> str:
        """Load the newest announcement, if any; the stream cursor to watch from."""
        assert self.streams is not None
        stream = self.streams.keys.weights
        try:
            latest = await self.streams.read_latest(stream, WeightAnnouncement)
        except ProtocolError as exc:
            log.error("newest entry of %s is unreadable (%s); waiting for the next announcement", stream, exc)
            newest = range_entries(await self.streams.redis.xrevrange(stream, count=1))
            return as_text(newest[0][0]) if newest else "0-0"
        if latest is None:
            log.info("no weight announcement yet; serving the initial weights as version -1")
            return "0-0"
        if latest.msg.transport == "collective":
            await self._load_snapshot()
        else:
            await self.apply(_order(latest.msg))
        return latest.entry_id

    async def _load_snapshot(self) -> None:
        """The run's versions move collectively: load the newest one on disk, if any (this generator
        joins the transfer group at the next refit)."""
        assert self.streams is not None
        raw = await self.streams.redis.get(self.streams.keys.weights_snapshot)
        if raw is None:
            log.warning("no weight snapshot on disk yet; serving the initial weights until the next refit")
            return
        try:
            snap = decode(raw if isinstance(raw, bytes) else raw.encode(), WeightSnapshot)
        except ProtocolError as exc:
            log.error("the weight snapshot record is unreadable (%s); serving the initial weights", exc)
            return
        log.info("loading weight version %d from its snapshot %s", snap.version, snap.path)
        await self.apply(
            LoadOrder(version=snap.version, path=snap.path, checksum=snap.checksum, files=snap.files or None)
        )

    def stop(self) -> None:
        """End ``watch`` after its current read (at most block_ms), even if a cancellation is lost
        inside the Redis client (redis-py can swallow one)."""
        self._stopping = True

    async def watch(self, cursor: str) -> None:
        """Apply announcements after ``cursor`` until stopped or cancelled; only the newest of a
        backlog loads."""
        assert self.streams is not None
        stream = self.streams.keys.weights
        log.info("watching %s after %s", stream, cursor)
        while not self._stopping:
            try:
                batch = await self.streams.read_after(stream, cursor, WeightAnnouncement, block_ms=self.block_ms)
            except (RedisError, OSError) as exc:
                log.warning("reading %s failed (%s); retrying in %.0fs", stream, exc, _RETRY_S)
                await asyncio.sleep(_RETRY_S)
                continue
            if not batch:
                continue
            cursor = batch[-1].entry_id
            good = [d.msg for d in batch if d.msg is not None]
            if good:
                await self._follow(good)

    async def _follow(self, announcements: list[WeightAnnouncement]) -> None:
        """Act on a batch in order: of the filesystem versions only the newest loads; collective
        orders (joins, then transfers) are each acted on, since their bytes come only once."""
        files = [a for a in announcements if a.transport == "filesystem"]
        newest = max(files, key=lambda a: a.version) if files else None
        if len(files) > 1 and newest is not None:
            log.info("%d announcements arrived together; loading only version %d", len(files), newest.version)
        for ann in announcements:
            if ann.collective is not None:
                if self.runtime.worker_id not in ann.collective.ranks:
                    continue
                if ann.collective.update_info is None:
                    await self.join(ann.collective, ann.version)
                else:
                    await self.apply(_order(ann))
            elif ann is newest:
                await self.apply(_order(ann))


def _order(ann: WeightAnnouncement) -> LoadOrder:
    return LoadOrder(
        version=ann.version,
        path=ann.path,
        checksum=ann.checksum or None,
        mode=ann.mode,
        transport=ann.transport,
        files=ann.files or None,
        collective=ann.collective,
        probe=ann.probe or None,
    )


def _own_init_info(order: CollectiveOrder, worker_id: str, rank: int) -> dict[str, Any]:
    """This generator's init info out of ``order``'s: its first engine rank's place in the group,
    and, in a resharding transfer, its own engine ranks' links only."""
    info = {**order.init_info, "rank_offset": rank}
    receives = info.get("receives")
    if isinstance(receives, dict):
        info["receives"] = receives[worker_id]
    return info

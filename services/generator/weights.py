"""Weight versions: follow the run's ``weights`` stream, load each new version, acknowledge it.

One code path for every load (the watcher and ``POST /admin/load_weights`` both call
`WeightSync.apply`). For an announcement newer than the served version::

    verify checksum --> pause (close the gate; drain up to generator.drain_timeout_s, or keep)
      --> load in place --> reset the prefix cache if caching is effectively on (False = failure)
      --> set weight_version --> resume (open the gate) --> WeightAck(ok, cache_reset, load_s)

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

from redis.exceptions import RedisError

from services.generator.engine import PauseMode
from services.generator.metrics import GeneratorMetrics
from services.generator.runtime import LocalPause, Runtime
from shared import keys as K
from shared.protocol import ProtocolError, WeightAck, WeightAnnouncement
from shared.redis_replies import as_text, range_entries
from shared.streams import StreamClient
from shared.weights_format import checksum_dir, safetensors_files

log = logging.getLogger(__name__)

_BLOCK_MS = 1000
_RETRY_S = 1.0


class RefitError(RuntimeError):
    """A weight version could not be put into service."""


@dataclass(frozen=True)
class LoadOrder:
    """What to load: from an announcement or from the admin route."""

    version: int
    path: str
    checksum: str | None
    mode: PauseMode = "drain"


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
        if self.streams is not None:
            try:
                await self.streams.publish(self.streams.keys.weight_acks, ack, maxlen=K.WEIGHT_ACKS_MAXLEN)
            except (RedisError, OSError) as exc:
                # The client already retried with backoff; the trainer's refit deadline reports it.
                log.error("could not publish the ack of weight version %d: %s", order.version, exc)
        return ack

    async def _apply(self, order: LoadOrder) -> WeightAck:
        rt = self.runtime
        async with self._lock:
            same_weights = order.checksum is None or order.checksum == rt.weight_checksum
            if order.version == rt.weight_version and same_weights and rt.error is None:
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
                cache_reset = await self._load(order)
            except Exception as exc:
                error = f"weight version {order.version} from {order.path}: {type(exc).__name__}: {exc}"
                rt.fail(error)
                self.metrics.refits.labels("failed").inc()
                return WeightAck(
                    worker_id=rt.worker_id, version=order.version, ok=False, error=error, load_s=time.monotonic() - t0
                )
            load_s = time.monotonic() - t0
            rt.last_refit_s = load_s
            self.metrics.refits.labels("ok").inc()
            self.metrics.refit_seconds.observe(load_s)
            log.info("serving weight version %d (%.2fs, prefix cache reset: %s)", order.version, load_s, cache_reset)
            return WeightAck(
                worker_id=rt.worker_id, version=order.version, ok=True, cache_reset=cache_reset, load_s=load_s
            )

    async def _load(self, order: LoadOrder) -> bool:
        """Pause, load, reset, bump the version, resume; True when the prefix cache was reset."""
        rt, engine = self.runtime, self.runtime.engine
        async with asyncio.timeout(self.load_timeout_s):
            await self._verify(order)
        try:
            await rt.pause(LocalPause.REFIT, order.mode)
            async with asyncio.timeout(self.load_timeout_s):
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
            rt.weight_checksum = order.checksum
            rt.error = None
            return cache_reset
        finally:
            await rt.resume(LocalPause.REFIT)

    async def _verify(self, order: LoadOrder) -> None:
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
        await self.apply(_order(latest.msg))
        return latest.entry_id

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
            if not good:
                continue
            newest = max(good, key=lambda a: a.version)
            if len(good) > 1:
                log.info("%d announcements arrived together; loading only version %d", len(good), newest.version)
            await self.apply(_order(newest))


def _order(ann: WeightAnnouncement) -> LoadOrder:
    return LoadOrder(version=ann.version, path=ann.path, checksum=ann.checksum, mode=ann.mode)

"""Refit: publish a weight version and wait until every live generator confirms it.

    close launch gate -> write safetensors folder (atomic rename) -> checksum -> announce on the
    weights stream -> wait for a WeightAck from every registered generator -> reopen the gate

Generators drain (or, with in-flight weight updates, freeze) their requests, load, reset their
prefix cache and ack; see services/generator/weights.py. Every phase has a deadline. A generator
that reports a failure, or does not confirm before the deadline, fails the refit loudly with its
name (never a silent hang).

Membership is read from the registry at every refit, so the set follows scaling: the refit waits
for the generators that serve at that moment. One still ``starting`` is not waited for (it loads
the newest announced version itself before it reports ready), nor one that is ``draining`` (it is
leaving). A generator that leaves the registry or starts draining while we wait is dropped from
the set, with a warning, and counted in ``RefitReport.dropped`` and ``dropped_total``. After Redis
answered late (frozen, overloaded, failing over), a generator missing from the registry gets
ABSENCE_GRACE_S to heartbeat again before it is dropped: no heartbeat landed while Redis did not
answer, so every live worker looks expired until its next one.

Owned by the trainer's control plane; the learner's ``export_weights`` is passed in.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared import keys as K
from shared.pause import PauseControl, PauseReason
from shared.protocol import WeightAck, WeightAnnouncement
from shared.records import RefitSummary
from shared.redis_replies import as_text, range_entries
from shared.registry import live_workers
from shared.streams import StreamClient
from shared.weights_format import checksum_dir, dir_num_bytes

log = logging.getLogger(__name__)


class RefitError(RuntimeError):
    """A weight version could not be confirmed by every generator."""


@dataclass
class RefitReport:
    version: int
    save_s: float  # close the gate and write the safetensors folder
    confirm_s: float  # checksum, announce, wait for every generator, prune old versions
    total_s: float
    generators: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # left or began draining before confirming
    checksum_s: float = 0.0  # part of confirm_s

    def summary(self) -> RefitSummary:
        """The step record's view: per-phase durations (write, checksum, confirm = announce to the
        last ack) and who confirmed."""
        return RefitSummary(
            total_s=self.total_s,
            write_s=self.save_s,
            checksum_s=self.checksum_s,
            confirm_s=self.confirm_s - self.checksum_s,
            generators=list(self.generators),
            dropped_generators=list(self.dropped),
        )


# Registry states of a generator the refit does not wait for: it catches up on its own (starting)
# or is leaving (draining).
NOT_WAITED_FOR = ("starting", "draining")

# A registry read that took this much longer than asked means Redis was stalled.
STALL_S = 1.0
# After a stall, how long a generator missing from the registry may take to heartbeat again.
ABSENCE_GRACE_S = K.HEARTBEAT_TTL_S  # a loaded machine can take seconds to land the first heartbeat after a stall


async def refit_members(streams: StreamClient) -> set[str]:
    """Live generators a refit must hear from now."""
    gens = await live_workers(streams.redis, streams.keys, "generator")
    return {g.worker_id for g in gens if g.state not in NOT_WAITED_FOR}


async def wait_for_generators(
    streams: StreamClient, timeout_s: float, note_latency: Callable[[float, float], None] | None = None
) -> list[str]:
    """Block until at least one generator that a refit waits for has registered; fail loudly at
    the deadline. ``note_latency(waited_s, asked_s)`` hears how long each registry read took."""
    deadline = time.monotonic() + timeout_s
    while True:
        t0 = time.monotonic()
        members = await refit_members(streams)
        if note_latency is not None:
            note_latency(time.monotonic() - t0, 0.0)
        if members:
            return sorted(members)
        if time.monotonic() > deadline:
            raise RefitError(
                f"no generator registered within {timeout_s:.0f}s (trainer.startup_timeout_s at start-up, "
                "trainer.refit_timeout_s later)"
            )
        await asyncio.sleep(0.5)


class WeightPublisher:
    def __init__(
        self,
        streams: StreamClient,
        pause: PauseControl,
        weights_dir: Path,
        *,
        timeout_s: float,
        in_flight_updates: bool,
        keep_versions: int = 3,
    ) -> None:
        self.streams = streams
        self.pause = pause
        self.weights_dir = weights_dir
        self.timeout_s = timeout_s
        self.mode: Literal["drain", "keep"] = "keep" if in_flight_updates else "drain"
        self.keep_versions = keep_versions
        self.dropped_total = 0  # generators dropped from a refit they did not confirm
        self._dropped: list[str] = []
        self._absence_proves_nothing_until = 0.0  # monotonic; set after a stalled Redis read

    async def refit(
        self, version: int, save: Callable[[Path], None], *, wait_for_generators_s: float | None = None
    ) -> RefitReport:
        """Publish ``version`` and wait for every live generator; ``wait_for_generators_s`` bounds
        the wait for the first generator to register (start-up), default the refit deadline."""
        t0 = time.perf_counter()
        self._dropped = []
        epoch = await self.pause.pause(PauseReason.REFIT)
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    path = await asyncio.to_thread(self._write, version, save)
                    t_saved = time.perf_counter()
                    checksum = await asyncio.to_thread(checksum_dir, path)
                    t_checksummed = time.perf_counter()
            except TimeoutError:
                raise RefitError(
                    f"writing weight version {version} to {self.weights_dir} took more than {self.timeout_s:.0f}s "
                    "(trainer.refit_timeout_s)"
                ) from None
            generators = await self._announce_and_confirm(
                wait_for_generators_s or self.timeout_s,
                WeightAnnouncement(
                    version=version,
                    path=str(path.resolve()),
                    checksum=checksum,
                    num_bytes=dir_num_bytes(path),
                    mode=self.mode,
                ),
            )
        finally:
            await self.pause.resume(PauseReason.REFIT, epoch)
        await asyncio.to_thread(self._prune, version)
        t1 = time.perf_counter()
        report = RefitReport(
            version,
            t_saved - t0,
            t1 - t_saved,
            t1 - t0,
            generators,
            dropped=list(self._dropped),
            checksum_s=t_checksummed - t_saved,
        )
        log.info(
            "refit to v%d confirmed by %d generator(s) (%s) in %.2fs (save %.2fs)%s",
            version,
            len(generators),
            ", ".join(generators),
            report.total_s,
            report.save_s,
            f"; dropped {', '.join(report.dropped)}" if report.dropped else "",
        )
        return report

    def _write(self, version: int, save: Callable[[Path], None]) -> Path:
        final = self.weights_dir / f"v{version:06d}"
        tmp = self.weights_dir / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def _note_latency(self, waited_s: float, asked_s: float) -> None:
        if waited_s > asked_s + STALL_S:
            self._absence_proves_nothing_until = time.monotonic() + ABSENCE_GRACE_S
            log.warning(
                "Redis answered after %.1fs; generators missing from the registry get %.0fs to heartbeat "
                "again before the refit stops waiting for them",
                waited_s,
                ABSENCE_GRACE_S,
            )

    async def _leaving(self, waiting: set[str]) -> set[str]:
        """Generators of ``waiting`` the refit stops waiting for: those now starting or draining,
        and those missing from the registry (unless Redis was stalled a moment ago)."""
        t0 = time.monotonic()
        gens = {g.worker_id: g.state for g in await live_workers(self.streams.redis, self.streams.keys, "generator")}
        self._note_latency(time.monotonic() - t0, 0.0)
        absence_counts = time.monotonic() >= self._absence_proves_nothing_until
        return {w for w in waiting if (gens[w] in NOT_WAITED_FOR if w in gens else absence_counts)}

    async def _announce_and_confirm(self, registration_timeout_s: float, ann: WeightAnnouncement) -> list[str]:
        expected = set(await wait_for_generators(self.streams, registration_timeout_s, self._note_latency))
        last = range_entries(await self.streams.redis.xrevrange(self.streams.keys.weight_acks, count=1))
        cursor = as_text(last[0][0]) if last else "0-0"
        await self.streams.publish(self.streams.keys.weights, ann, maxlen=K.WEIGHTS_MAXLEN)
        confirmed: dict[str, WeightAck] = {}
        deadline = time.monotonic() + self.timeout_s
        while expected - set(confirmed):
            if time.monotonic() > deadline:
                missing = sorted(expected - set(confirmed))
                raise RefitError(
                    f"weight version {ann.version} not confirmed within {self.timeout_s:.0f}s "
                    f"(trainer.refit_timeout_s) by generator(s): {', '.join(missing)}"
                )
            t0 = time.monotonic()
            acks = await self.streams.read_after(self.streams.keys.weight_acks, cursor, WeightAck, block_ms=500)
            self._note_latency(time.monotonic() - t0, 0.5)
            for d in acks:
                cursor = d.entry_id
                ack = d.msg
                if ack is None or ack.version != ann.version:
                    continue
                if not ack.ok:
                    raise RefitError(
                        f"generator {ack.worker_id} failed to load weight version {ann.version}: {ack.error}"
                    )
                confirmed[ack.worker_id] = ack
            gone = await self._leaving(expected - set(confirmed))
            if gone:
                log.warning(
                    "generator(s) left or began draining during refit to v%d, not waited for: %s",
                    ann.version,
                    ", ".join(sorted(gone)),
                )
                expected -= gone
                self._dropped += sorted(gone)
                self.dropped_total += len(gone)
                if not expected and not confirmed:
                    raise RefitError(f"every generator left before confirming weight version {ann.version}")
        return sorted(confirmed)

    def _prune(self, current: int) -> None:
        versions = sorted(p for p in self.weights_dir.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)

"""Refit: publish a weight version and wait until every live generator confirms it.

    close launch gate -> the transport moves the version and announces it on the weights stream
    (a safetensors folder, or vLLM's weight-transfer engines: `services.trainer.weight_transport`)
    -> wait for a WeightAck from every generator it went to -> reopen the gate -> housekeeping

Generators drain (or, with in-flight weight updates, freeze) their requests, load, reset their
prefix cache and ack; see services/generator/weights.py. Every phase has a deadline. A generator
that reports a failure, or does not confirm before the deadline, fails the refit loudly with its
name (never a silent hang). After a collective transfer every ack must carry the checksum the
trainer sent, and the engines' own checksums must agree across generators.

A transfer that fails (`TransferFailed`) is examined: the generators that vanished from the
registry meanwhile were lost (killed, crashed) and are dropped, and the version is sent again to
the others over a fresh group, up to ``refit.max_attempts`` in all. When nobody was lost, the
refit fails with what each generator reported (a worker-side error, by name).

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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import msgspec

from services.trainer.refit_probe import ProbeMismatch, RefitProbe
from services.trainer.weight_transport import Sent, TransferFailed, WeightTransport
from shared import keys as K
from shared.pause import PauseControl, PauseReason
from shared.protocol import WeightAck, WeightAnnouncement
from shared.records import RefitSummary
from shared.redis_replies import as_text, range_entries
from shared.registry import live_workers
from shared.streams import StreamClient

log = logging.getLogger(__name__)


class RefitError(RuntimeError):
    """A weight version could not be confirmed by every generator."""


@dataclass
class RefitReport:
    version: int
    save_s: float  # moving the bytes: write the folder, or the whole collective transfer
    confirm_s: float  # the rest until every generator confirmed, housekeeping included
    total_s: float
    generators: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # left, began draining or lost before confirming
    checksum_s: float = 0.0  # digests are computed while writing: no separate pass
    transport: str = "filesystem"
    num_bytes: int = 0
    attempts: int = 1
    probe_error: float | None = None  # `refit_probe`: the worst generator's, None when not probed
    changed_fraction: float | None = None  # resharding refits: elements changed since the engines' version

    def summary(self) -> RefitSummary:
        """The step record's view: per-phase durations (move, confirm = announce to the last ack)
        and who confirmed."""
        return RefitSummary(
            total_s=self.total_s,
            write_s=self.save_s,
            checksum_s=self.checksum_s,
            confirm_s=self.confirm_s - self.checksum_s,
            generators=list(self.generators),
            dropped_generators=list(self.dropped),
            transport=self.transport,
            num_bytes=self.num_bytes,
            attempts=self.attempts,
            probe_error=self.probe_error,
            changed_fraction=self.changed_fraction,
        )


T = TypeVar("T")

# Registry states of a generator the refit does not wait for: it catches up on its own (starting)
# or is leaving (draining).
NOT_WAITED_FOR = ("starting", "draining")

# A registry read that took this much longer than asked means Redis was stalled.
STALL_S = 1.0
# After a stall, how long a generator missing from the registry may take to heartbeat again.
ABSENCE_GRACE_S = K.HEARTBEAT_TTL_S  # a loaded machine can take seconds to land the first heartbeat after a stall
# After a failed transfer, how long to wait for a lost generator's registry entry to expire.
LOSS_GRACE_S = K.HEARTBEAT_TTL_S + 2.0
# A generator that reported an error while the transfer still runs: how long the transfer may take
# to fail on its own before the refit fails with that error (a group that cannot form waits for
# its whole timeout otherwise).
ERROR_GRACE_S = 10.0


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
        transport: WeightTransport,
        *,
        timeout_s: float,
        in_flight_updates: bool,
        max_attempts: int = 1,
        probe: RefitProbe | None = None,
    ) -> None:
        self.streams = streams
        self.pause = pause
        self.transport = transport
        self.timeout_s = timeout_s
        self.mode: Literal["drain", "keep"] = "keep" if in_flight_updates else "drain"
        self.max_attempts = max_attempts
        self.probe = probe
        self._probe_error: float | None = None
        self.dropped_total = 0  # generators dropped from a refit they did not confirm
        self._dropped: list[str] = []
        self._absence_proves_nothing_until = 0.0  # monotonic; set after a stalled Redis read

    async def refit(self, version: int, *, wait_for_generators_s: float | None = None) -> RefitReport:
        """Publish ``version`` and wait for every live generator; ``wait_for_generators_s`` bounds
        the wait for the first generator to register (start-up), default the refit deadline."""
        t0 = time.perf_counter()
        self._dropped = []
        self._probe_error = None
        if self.probe is not None:
            await self.probe.prepare(version)  # the trainer's own logprobs at the version it sends
        epoch = await self.pause.pause(PauseReason.REFIT)
        try:
            generators, sent, attempts = await self._move(version, wait_for_generators_s or self.timeout_s)
        finally:
            await self.pause.resume(PauseReason.REFIT, epoch)
        await self.transport.after_confirmed(version)
        t1 = time.perf_counter()
        report = RefitReport(
            version,
            sent.move_s,
            t1 - t0 - sent.move_s,
            t1 - t0,
            generators,
            dropped=list(self._dropped),
            transport=self.transport.name,
            num_bytes=sent.num_bytes,
            attempts=attempts,
            probe_error=self._probe_error,
            changed_fraction=sent.changed_fraction,
        )
        log.info(
            "refit to v%d (%s, %.1f MiB) confirmed by %d generator(s) (%s) in %.2fs (moving the bytes %.2fs)%s",
            version,
            self.transport.name,
            sent.num_bytes / 2**20,
            len(generators),
            ", ".join(generators),
            report.total_s,
            report.save_s,
            f"; dropped {', '.join(report.dropped)}" if report.dropped else "",
        )
        return report

    async def _timed(self, call: Awaitable[T], asked_s: float = 0.0) -> T:
        """One of the refit's Redis calls, timed: one that took STALL_S longer than ``asked_s``
        (a blocking read's block) means Redis was stalled, and registry absences prove nothing
        for a while (`_note_latency`). Every call of the refit goes through here: a stall can
        land on any of them, and the heartbeats it held back land after it."""
        t0 = time.monotonic()
        try:
            return await call
        finally:
            self._note_latency(time.monotonic() - t0, asked_s)

    async def _announce(self, ann: WeightAnnouncement) -> None:
        probe = self.probe.tokens if self.probe is not None else []
        announcement = msgspec.structs.replace(ann, mode=self.mode, probe=probe)
        await self._timed(self.streams.publish(self.streams.keys.weights, announcement, maxlen=K.WEIGHTS_MAXLEN))

    async def _ack_cursor(self) -> str:
        last = range_entries(await self._timed(self.streams.redis.xrevrange(self.streams.keys.weight_acks, count=1)))
        return as_text(last[0][0]) if last else "0-0"

    async def _move(self, version: int, registration_timeout_s: float) -> tuple[list[str], Sent, int]:
        """Send ``version`` until every generator it went to confirmed it (retrying without the
        generators a failed transfer lost); who confirmed, what was sent, and the attempts made."""
        members = sorted(await wait_for_generators(self.streams, registration_timeout_s, self._note_latency))
        attempt = 0
        while True:
            attempt += 1
            cursor = await self._ack_cursor()
            try:
                sent = await self._send(version, members, cursor)
            except TransferFailed as exc:
                lost, errors = await self._lost_in_transfer(version, members, cursor)
                if not lost:
                    raise RefitError(_transfer_error(version, self.transport.name, exc, errors)) from exc
                self._drop(lost, f"lost during the transfer of v{version}")
                members = [m for m in members if m not in lost]
                if not members:
                    raise RefitError(
                        f"every generator was lost during the transfer of weight version {version}"
                    ) from exc
                if attempt >= self.max_attempts:
                    raise RefitError(
                        f"weight version {version}: {attempt} transfer attempt(s) failed (refit.max_attempts); "
                        f"last: {exc}"
                    ) from exc
                log.warning("sending weight version %d again to %s over a fresh group", version, ", ".join(members))
                continue
            return await self._confirm(version, set(members), cursor, sent), sent, attempt

    async def _send(self, version: int, members: list[str], cursor: str) -> Sent:
        """The transport's send, bounded by the refit deadline; a generator's error meanwhile fails
        the refit by name once the transfer did not fail on its own within ERROR_GRACE_S."""
        task = asyncio.create_task(self.transport.send(version, members, self._announce))
        errors: dict[str, str] = {}
        first_error_at: float | None = None
        deadline = time.monotonic() + self.timeout_s
        try:
            while not task.done():
                if time.monotonic() > deadline:
                    self.transport.forget()
                    raise RefitError(
                        f"moving weight version {version} ({self.transport.name}) took more than "
                        f"{self.timeout_s:.0f}s (trainer.refit_timeout_s)"
                    )
                if first_error_at is not None and time.monotonic() - first_error_at > ERROR_GRACE_S:
                    self.transport.forget()
                    raise RefitError(_transfer_error(version, self.transport.name, None, errors))
                await asyncio.wait({task}, timeout=0.5)
                if not task.done():
                    cursor = await self._read_errors(version, cursor, errors, block_ms=1)
                    if errors and first_error_at is None:
                        first_error_at = time.monotonic()
            return task.result()
        finally:
            if not task.done():
                task.cancel()  # the transfer's thread ends at its own group timeout

    async def _read_errors(self, version: int, cursor: str, errors: dict[str, str], *, block_ms: int) -> str:
        """Collect failed acks of ``version`` after ``cursor`` into ``errors``; the new cursor."""
        read = self.streams.read_after(self.streams.keys.weight_acks, cursor, WeightAck, block_ms=block_ms)
        for d in await self._timed(read, block_ms / 1000):
            cursor = d.entry_id
            if d.msg is not None and d.msg.version == version and not d.msg.ok:
                errors[d.msg.worker_id] = d.msg.error or "failed"
        return cursor

    async def _lost_in_transfer(self, version: int, members: list[str], cursor: str) -> tuple[set[str], dict[str, str]]:
        """After a failed transfer: the generators that left the registry (lost), and what the
        others reported. Waits until each one is accounted for, at most LOSS_GRACE_S."""
        errors: dict[str, str] = {}
        lost: set[str] = set()
        deadline = time.monotonic() + LOSS_GRACE_S
        while time.monotonic() < deadline:
            cursor = await self._read_errors(version, cursor, errors, block_ms=500)
            lost = await self._leaving(set(members))
            if lost and set(members) - lost <= set(errors):
                break
        return lost, errors

    def _drop(self, gone: set[str], why: str) -> None:
        log.warning("generator(s) %s, not waited for: %s", why, ", ".join(sorted(gone)))
        self._dropped += sorted(gone)
        self.dropped_total += len(gone)

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
        registry = await self._timed(live_workers(self.streams.redis, self.streams.keys, "generator"))
        gens = {g.worker_id: g.state for g in registry}
        absence_counts = time.monotonic() >= self._absence_proves_nothing_until
        return {w for w in waiting if (gens[w] in NOT_WAITED_FOR if w in gens else absence_counts)}

    async def _confirm(self, version: int, expected: set[str], cursor: str, sent: Sent) -> list[str]:
        """Wait for an ok ack of ``version`` from every generator of ``expected`` (those that leave
        meanwhile are dropped); check the checksums they report against ``sent``."""
        confirmed: dict[str, WeightAck] = {}
        deadline = time.monotonic() + self.timeout_s
        while expected - set(confirmed):
            if time.monotonic() > deadline:
                missing = sorted(expected - set(confirmed))
                raise RefitError(
                    f"weight version {version} not confirmed within {self.timeout_s:.0f}s "
                    f"(trainer.refit_timeout_s) by generator(s): {', '.join(missing)}"
                )
            acks = await self._timed(
                self.streams.read_after(self.streams.keys.weight_acks, cursor, WeightAck, block_ms=500), 0.5
            )
            for d in acks:
                cursor = d.entry_id
                ack = d.msg
                if ack is None or ack.version != version or ack.worker_id not in expected:
                    continue
                if sent.group is not None and ack.group != sent.group:
                    continue  # an answer to an earlier, failed transfer of this version
                if not ack.ok:
                    raise RefitError(f"generator {ack.worker_id} failed to load weight version {version}: {ack.error}")
                want = sent.checksums.get(ack.worker_id) if sent.checksums is not None else sent.checksum
                if want is not None and ack.checksum != want:
                    raise RefitError(
                        f"generator {ack.worker_id} received weight version {version} with checksum {ack.checksum}; "
                        f"the trainer sent {want}"
                    )
                confirmed[ack.worker_id] = ack
            gone = await self._leaving(expected - set(confirmed))
            if gone:
                self._drop(gone, f"left or began draining during the refit to v{version}")
                expected -= gone
                if not expected and not confirmed:
                    raise RefitError(f"every generator left before confirming weight version {version}")
        _check_engine_checksums(version, confirmed)
        if self.probe is not None:
            try:
                self._probe_error = self.probe.check(version, confirmed)
            except ProbeMismatch as exc:
                raise RefitError(str(exc)) from exc
        return sorted(confirmed)


def check_refit_fidelity(version: int, gen_kl_error: float | None, bound: float) -> None:
    """Raise when the rows ``version`` generated wholly, in the first step that has some, saw
    ``gen_kl_error`` above ``bound`` (``refit.max_gen_kl_error``). The trainer scores them with the
    weights that generated them, so the error is numerical noise (NeMo-RL's release runs assert a
    mean below 0.004 on a 397B model, drift included); a refit that delivered other weights shows
    up as an error of order 0.1 to 1 (garbage served with no error anywhere else, NeMo-RL #2895)."""
    if gen_kl_error is not None and gen_kl_error > bound:
        raise RefitError(
            f"gen_kl_error {gen_kl_error:.4g} on the rows weight version {version} generated (the first step "
            f"trained on them) exceeds refit.max_gen_kl_error {bound:g}: the generators serve other weights than "
            "the trainer holds"
        )
    log.info("refit to v%d checked: gen_kl_error %.3g <= %g", version, gen_kl_error or 0.0, bound)


def _check_engine_checksums(version: int, acks: dict[str, WeightAck]) -> None:
    """Generators holding the same version hold the same weights: their engines' checksums agree."""
    by_sum: dict[str, list[str]] = {}
    for worker, ack in acks.items():
        if ack.engine_checksum is not None:
            by_sum.setdefault(ack.engine_checksum, []).append(worker)
    if len(by_sum) > 1:
        groups = "; ".join(f"{', '.join(sorted(ws))}: {s}" for s, ws in sorted(by_sum.items()))
        raise RefitError(f"generators hold different weights after loading version {version} ({groups})")


def _transfer_error(version: int, transport: str, exc: BaseException | None, errors: dict[str, str]) -> str:
    said = "; ".join(f"generator {w}: {e}" for w, e in sorted(errors.items())) or "no generator reported an error"
    cause = f" ({exc})" if exc is not None else ""
    return f"the {transport} transfer of weight version {version} failed{cause}: {said}"

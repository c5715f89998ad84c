"""The run's pause protocol, in one place: reasons, epochs, the launch gate.

A pause is recorded in the run's pause hash (`shared.keys.RunKeys.pause`) as ``reason -> epoch``.
Every pause takes a fresh epoch from a Redis counter; a resume names the epoch it ends, and a stale
resume (an older epoch of the same reason) changes nothing, so a late resume from an earlier
validation cannot end a newer pause. Each reason holds its own pause (the latest one of that
reason): a user pause and a refit can be active together, and ending one leaves the other.

    reason       set by                        closes the launch gate   stops training-task issue
    USER         POST /pause on the trainer    yes                      yes (and steps, at a boundary)
    INFRA        the trainer, over its budget  yes                      yes (and the step it holds)
                 of infrastructure failures
    REFIT        the trainer's weight refit    yes                      no
    VALIDATION   the trainer's validation      no                       yes

USER and INFRA hold the run (`PauseReason.holds_run`) until POST /resume (`streamrl resume`) ends
them.

Writers: the trainer (`PauseControl`). Readers: gateway workers (`launch_gate_closed`, polled
before every task read), `streamrl status` and the trainer's /status (`read_pauses`).
"""

from __future__ import annotations

import enum
import logging

import redis.asyncio as aioredis

from shared import keys as K

log = logging.getLogger(__name__)


class PauseReason(enum.StrEnum):
    USER = "user"
    INFRA = "infra_failures"  # grpo.max_infra_failure_fraction (services.trainer.infra_budget)
    REFIT = "refit"
    VALIDATION = "validation"

    @property
    def closes_launch_gate(self) -> bool:
        """Gateways launch no new rollout while a pause of this reason is active."""
        return self in (PauseReason.USER, PauseReason.INFRA, PauseReason.REFIT)

    @property
    def stops_task_issue(self) -> bool:
        """The trainer issues no training task while a pause of this reason is active."""
        return self in (PauseReason.USER, PauseReason.INFRA, PauseReason.VALIDATION)

    @property
    def holds_run(self) -> bool:
        """The trainer takes no step while a pause of this reason is active; a resume ends it."""
        return self in (PauseReason.USER, PauseReason.INFRA)


# Atomically end a pause only if it is still the one with this epoch.
_RESUME_IF_EPOCH = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and cur == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) return 1 end
return 0
"""


def _reason(raw: bytes | str) -> PauseReason | str:
    """A reason read from Redis; one this version does not know (a newer writer) stays a string."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    try:
        return PauseReason(text)
    except ValueError:
        return text


async def read_pauses(redis: aioredis.Redis, keys: K.RunKeys) -> dict[str, int]:
    """Active pauses, ``reason -> epoch``."""
    raw = await redis.hgetall(keys.pause)
    return {str(_reason(k)): int(v) for k, v in raw.items()}


async def launch_gate_closed(redis: aioredis.Redis, keys: K.RunKeys) -> bool:
    """True while any active pause closes the launch gate. An unknown reason closes it too: a
    reader older than the writer errs on the side of launching nothing."""
    for raw in await redis.hkeys(keys.pause):
        reason = _reason(raw)
        if not isinstance(reason, PauseReason) or reason.closes_launch_gate:
            return True
    return False


class PauseControl:
    """The trainer's writer of the pause hash."""

    def __init__(self, redis: aioredis.Redis, run_keys: K.RunKeys) -> None:
        self.redis = redis
        self.keys = run_keys
        self._resume = redis.register_script(_RESUME_IF_EPOCH)

    async def pause(self, reason: PauseReason) -> int:
        epoch = int(await self.redis.incr(self.keys.pause_epoch))
        await self.redis.hset(self.keys.pause, reason.value, str(epoch))
        log.info("paused (%s) epoch %d", reason.value, epoch)
        return epoch

    async def resume(self, reason: PauseReason, epoch: int) -> bool:
        ok = bool(await self._resume(keys=[self.keys.pause], args=[reason.value, str(epoch)]))
        if ok:
            log.info("resumed (%s) epoch %d", reason.value, epoch)
        else:
            log.warning("stale resume ignored: %s epoch %d is not the active pause", reason.value, epoch)
        return ok

    async def reasons(self) -> dict[str, int]:
        """Active pauses, ``reason -> epoch`` (keys compare equal to `PauseReason` members)."""
        return await read_pauses(self.redis, self.keys)

    async def active(self, reason: PauseReason) -> int | None:
        """The epoch of the active pause of ``reason``, or None."""
        return (await self.reasons()).get(reason.value)

    async def holding(self) -> dict[PauseReason, int]:
        """The active pauses that hold the run (`PauseReason.holds_run`), with their epochs."""
        active = await self.reasons()
        return {r: e for k, e in active.items() if isinstance(r := _reason(k), PauseReason) and r.holds_run}

    async def stops_task_issue(self) -> bool:
        """True while a pause that stops training-task issue is active."""
        return any(isinstance(r := _reason(k), PauseReason) and r.stops_task_issue for k in await self.reasons())

"""Pause state shared through Redis: reference-counted reasons, each with an epoch.

Every pause gets a fresh epoch from a Redis counter and is recorded as ``reason -> epoch`` in the
run's pause hash. A resume names the epoch it ends; a stale resume (an older epoch of the same
reason) changes nothing, so a late "resume" from an earlier validation cannot end a newer pause.
Reasons in LAUNCH_GATE_REASONS also stop gateways from launching rollouts (they watch the hash);
the others only stop the trainer from issuing training tasks.

Used by the trainer runtime (refit, validation) and its REST API (user pause/resume).
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from shared import keys as K

log = logging.getLogger(__name__)

# Atomically end a pause only if it is still the one with this epoch.
_RESUME_IF_EPOCH = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and cur == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) return 1 end
return 0
"""


class PauseControl:
    def __init__(self, redis: aioredis.Redis, run_keys: K.RunKeys) -> None:
        self.redis = redis
        self.keys = run_keys
        self._resume = redis.register_script(_RESUME_IF_EPOCH)

    async def pause(self, reason: str) -> int:
        epoch = int(await self.redis.incr(self.keys.pause_epoch))
        await self.redis.hset(self.keys.pause, reason, str(epoch))
        log.info("paused (%s) epoch %d", reason, epoch)
        return epoch

    async def resume(self, reason: str, epoch: int) -> bool:
        ok = bool(await self._resume(keys=[self.keys.pause], args=[reason, str(epoch)]))
        if ok:
            log.info("resumed (%s) epoch %d", reason, epoch)
        else:
            log.warning("stale resume ignored: %s epoch %d is not the active pause", reason, epoch)
        return ok

    async def reasons(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.pause)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def clear(self) -> None:
        await self.redis.delete(self.keys.pause)

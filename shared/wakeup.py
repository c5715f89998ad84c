"""`Wakeup`: the wait-for-news-or-a-timeout primitive of the services' polling loops.

A producer (a stream consumer that staged a group, a rollout that freed a slot) calls `set`; one
consumer loop calls ``await wakeup.wait(timeout_s)``, which returns True when news came and False
when the timeout passed, and re-arms itself either way; `clear` drops news that came before the
loop looked. The loops re-check their condition after every wake-up, so a missed edge costs at
most one timeout, never a hang.

Used by the trainer's trajectory intake (a group staged), its validation runner (a validation
rollout arrived) and the gateway's task loop (a rollout ended: a slot is free).
"""

from __future__ import annotations

import asyncio


class Wakeup:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._event.clear()

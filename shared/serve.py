"""A uvicorn server that drains *before* it stops accepting connections.

uvicorn's own shutdown closes the listening socket first, then waits for open requests, then runs
the app's lifespan shutdown. A gateway's environments reach the model through the gateway's own
session proxy and a multi-turn rollout opens new connections between turns, so draining in the
lifespan is too late: the rollouts it waits for can no longer reach the proxy. A generator being
scaled down must likewise keep serving the sessions it already has while gateways route new ones
elsewhere. So, on the first SIGTERM or SIGINT this server runs ``drain()`` while still serving
(bounded by ``drain_timeout_s``), then shuts down as uvicorn does. A second signal skips the rest
of the drain.

Used by the generator's and the gym gateway's ``__main__``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)


class DrainFirstServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[object]], drain_timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._drain_signal: int | None = None
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler: only flags here; the drain starts on the loop's next tick.
        if self._drain_signal is None and not self.should_exit:
            self._drain_signal = sig
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_signal is not None and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit(), name="drain")
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            async with asyncio.timeout(self._drain_timeout_s):
                await self._drain()
        except TimeoutError:
            log.warning("drain did not finish within %.0fs; shutting down anyway", self._drain_timeout_s)
        except Exception:
            log.exception("drain failed; shutting down anyway")
        finally:
            super().handle_exit(self._drain_signal, None)

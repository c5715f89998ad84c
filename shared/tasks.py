"""Stopping asyncio tasks for certain, and bounding a shutdown step.

One ``task.cancel()`` does not always stop a task that talks to Redis. redis-py (8.1) sends every
command under ``asyncio.wait_for(write, socket_timeout)``, and on Python 3.11 ``wait_for`` drops a
cancel that lands in the loop turn in which the write completes: it returns the write's result
instead of raising (CPython gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``). The task
then carries on as if it had never been cancelled, and whoever waits for it waits for ever. A loop
of Redis GETs cancelled once at a random moment kept running after about half of the cancels
(Python 3.11.7, redis-py 8.1, a local Valkey). ``asyncio.timeout`` expires by cancelling too, so a
deadline around Redis calls can be lost the same way.

`cancel_and_wait` makes the cancel level-triggered, as trio and anyio do: the task is cancelled,
given ``grace_s`` to run its cleanup (its ``finally`` blocks) undisturbed, then cancelled again
every ``RECANCEL_S`` until it ends or ``timeout_s`` passes. `bounded` runs a shutdown step as a
task and stops it that way at its deadline. Every place that stops a task goes through them:
`shared.service.ServiceLifecycle.stop_tasks`, the trainer's SIGTERM path, the heartbeat, the
trajectory intake, a gateway's drain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

F = TypeVar("F", bound="asyncio.Future[Any]")

RECANCEL_S = 0.1  # after the grace period: how often a task still running is cancelled again
STOP_S = 5.0  # how long `bounded` waits for a step it stopped at its deadline


async def cancel_and_wait(tasks: Iterable[F], *, timeout_s: float, grace_s: float = 1.0) -> set[F]:
    """Cancel ``tasks`` and wait until every one ended, cancelling those still running again
    after ``grace_s`` and then every `RECANCEL_S`; returns those still running after
    ``timeout_s`` (the caller reports them). A cancel of the caller itself is passed on to
    ``tasks`` before it is raised."""
    loop = asyncio.get_running_loop()
    pending = {t for t in tasks if not t.done()}
    deadline = loop.time() + timeout_s
    grace_ends = loop.time() + min(grace_s, timeout_s)
    for t in pending:
        t.cancel()
    try:
        while pending:
            now = loop.time()
            if now >= deadline:
                break
            wait_s = (grace_ends - now) if now < grace_ends else RECANCEL_S
            _, pending = await asyncio.wait(pending, timeout=min(wait_s, deadline - now))
            if pending and loop.time() >= grace_ends:
                for t in pending:
                    t.cancel()
    except asyncio.CancelledError:
        for t in pending:
            t.cancel()
        raise
    return pending


async def bounded(step: Awaitable[Any], what: str, timeout_s: float) -> None:
    """Await a shutdown step for at most ``timeout_s``, then stop it (`cancel_and_wait`, up to
    `STOP_S` more); a failure or an overrun is logged, and shutdown goes on."""
    task = asyncio.ensure_future(step)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await cancel_and_wait([task], timeout_s=STOP_S, grace_s=0.0)
        raise
    if not done:
        log.warning("%s did not finish within %.0fs; stopped", what, timeout_s)
        if await cancel_and_wait([task], timeout_s=STOP_S, grace_s=0.0):
            log.warning("%s is still running after it was stopped", what)
        return
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc, exc_info=exc)

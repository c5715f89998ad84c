"""The HTTP plumbing of the fake servers (`tests.support.fakes.docker`, `tests.support.fakes.kube`):
an aiohttp app that sends every request to one handler, served on an event loop of its own in a
daemon thread, so that tests that drive a blocking client (a subprocess, a thread) can talk to it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ThreadedServer:
    """``handle`` served on the site ``site(runner)`` makes (a unix socket, a loopback port)."""

    def __init__(self, name: str, handle: Handler, site: Callable[[web.AppRunner], web.BaseSite]) -> None:
        self.name = name
        self._handle, self._site = handle, site
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self.port = 0  # the bound port of a TCP site

    def start(self) -> None:
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._started.wait(10), f"{self.name} did not start"

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = self._site(self._runner)
        self._loop.run_until_complete(site.start())
        if isinstance(site, web.TCPSite):
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)


async def read_json(request: web.Request) -> object:
    """The request's JSON body; None when it has none."""
    raw = await request.read()
    return json.loads(raw) if raw else None

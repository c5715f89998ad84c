"""Calls for a session this gateway worker does not hold, answered by the worker that does.

A NeMo-Gym config names one model server, but a run may have several gateway workers, each holding
the sessions of the rollouts it runs. A session route called for a session this worker does not
hold forwards the call as it came, once (``x-streamrl-forwarded``: a forwarded call is never sent
on), to the other live gateway workers of the registry until one answers other than "unknown
session"; the owner found is remembered (the last MAX_REMEMBERED_OWNERS sessions) for the
session's next calls. No worker holding it: a 404 naming ``session_id``. The caller's
``Authorization`` goes along: this worker checked it, and the owner checks it again (completing an
external session is a control route, `services.gym_gateway.external_routes`).

Built by `services.gym_gateway.app.build_app`; called by `services.gym_gateway.session_routes` and
`services.gym_gateway.external_routes`.
"""

from __future__ import annotations

from collections import OrderedDict

import aiohttp
from fastapi import Request
from fastapi.responses import Response

from services.gym_gateway.proxy import SessionProxy, unknown_session
from shared.registry import live_workers

FORWARDED_HEADER = "x-streamrl-forwarded"
MAX_REMEMBERED_OWNERS = 4096


async def peer_urls(proxy: SessionProxy, worker_id: str) -> list[str]:
    """Base URLs of the run's other live gateway workers."""
    gateways = await live_workers(proxy.pool.redis, proxy.pool.keys, "gym_gateway")
    return [w.url for w in gateways if w.worker_id != worker_id]


async def ask_peer(
    proxy: SessionProxy, method: str, url: str, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, bytes] | None:
    """(status, body) of another gateway worker's answer; None when it cannot be reached."""
    try:
        async with proxy.http.request(
            method, url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=proxy.request_timeout_s)
        ) as resp:
            return resp.status, await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        return None


class SessionForwarder:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.owners: OrderedDict[str, str] = OrderedDict()  # session id -> base URL of the worker holding it

    async def forward(self, request: Request, session_id: str, proxy: SessionProxy) -> Response:
        """The answer of the gateway worker holding ``session_id`` to ``request``."""
        if request.headers.get(FORWARDED_HEADER):
            raise unknown_session(session_id)
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json"), FORWARDED_HEADER: "1"}
        if authorization := request.headers.get("authorization"):
            headers["authorization"] = authorization
        for url in await self._candidates(session_id, proxy):
            got = await ask_peer(proxy, request.method, f"{url.rstrip('/')}{request.url.path}", headers, body)
            if got is None:
                continue  # a worker that went away holds no session we can reach
            status, answer = got
            if status == 404 and b'"session_id"' in answer:
                continue
            self._remember(session_id, url)
            return Response(answer, status_code=status, media_type="application/json")
        self.owners.pop(session_id, None)
        raise unknown_session(session_id)

    async def _candidates(self, session_id: str, proxy: SessionProxy) -> list[str]:
        if session_id in self.owners:
            return [self.owners[session_id]]
        return await peer_urls(proxy, self.worker_id)

    def _remember(self, session_id: str, url: str) -> None:
        self.owners[session_id] = url
        self.owners.move_to_end(session_id)
        while len(self.owners) > MAX_REMEMBERED_OWNERS:
            self.owners.popitem(last=False)

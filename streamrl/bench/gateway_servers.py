"""The servers of the gateway_scale benchmark (`streamrl.bench.gateway_scale`), each started in a
process of its own::

    python -m streamrl.bench.gateway_servers serve-upstream PORT
    python -m streamrl.bench.gateway_servers serve-gateway PORT UPSTREAM [routes-only]

* the stand-in generator: an aiohttp server answering every chat call like the generator does (the
  prompt ids, given in full at the top and in the message, the generated ids and logprobs, weight
  versions) after a fixed ``DELAY_S``; the prompt continues the request's
  ``required_prefix_token_ids``, so sessions grow a context as they would against a model;
* the gateway: the gateway's session routes, `SessionCalls` in front of them (not with
  ``routes-only``) and `SessionProxy`, under uvicorn, configured as the service configures them,
  with the stand-in as the one serving generator (no Redis, no task worker: sessions are opened
  through bench-only routes).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

import msgspec

from streamrl.bench.gateway_scale import DELAY_S, GEN_TOKENS, NEW_TOKENS, PROMPT_TOKENS, SIZES

if TYPE_CHECKING:
    from fastapi import FastAPI


# -- the stand-in generator -------------------------------------------------------------------


def serve_upstream(port: int) -> None:
    """Answer chat calls like the generator, ``DELAY_S`` after each request arrived."""
    from aiohttp import web

    from shared.openai_api import ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ResponseMessage, Usage

    decoder = msgspec.json.Decoder(ChatCompletionRequest)
    rng = random.Random(0)
    first = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    new = [rng.randrange(150_000) for _ in range(NEW_TOKENS)]
    gen = [rng.randrange(150_000) for _ in range(GEN_TOKENS)]
    logprobs = [-rng.random() for _ in range(GEN_TOKENS)]

    async def chat(request: web.Request) -> web.Response:
        req = decoder.decode(await request.read())
        prompt = (req.required_prefix_token_ids or first) + new
        await asyncio.sleep(DELAY_S)
        message = ResponseMessage(
            content="The apples are " + "counted " * 40,
            prompt_token_ids=prompt,
            generation_token_ids=gen,
            generation_log_probs=logprobs,
        )
        out = ChatCompletionResponse(
            id="chatcmpl-bench",
            created=int(time.time()),
            model="bench",
            choices=[ChatChoice(index=0, message=message, finish_reason="stop", token_ids=gen)],
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=GEN_TOKENS, total_tokens=len(prompt) + GEN_TOKENS),
            prompt_token_ids=prompt,
            weight_version=0,
            weight_version_end=0,
        )
        return web.Response(body=msgspec.json.encode(out), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, backlog=8192, print=None, access_log=None)


# -- the gateway ------------------------------------------------------------------------------


def _lifespan(upstream_url: str, request_timeout_s: float) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: a `SessionProxy` whose one serving generator is ``upstream_url`` (the
    registry is never read), start-up objects frozen as the gateway's lifespan does."""
    from services.gym_gateway.app import connector
    from services.gym_gateway.proxy import GeneratorPool, SessionProxy
    from shared import keys as K
    from shared.protocol import Heartbeat
    from shared.service import freeze_startup_objects
    from shared.streams import connect

    class StandInPool(GeneratorPool):
        """The stand-in as the one serving generator; the registry is never read."""

        async def _refresh(self, stale_before: float) -> None:
            hb = Heartbeat(worker_id="upstream", kind="generator", url=upstream_url, state="ready", weight_version=0)
            self._ready, self._at = [hb], float("inf")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import aiohttp

        async with aiohttp.ClientSession(connector=connector(max(SIZES))) as http:
            pool = StandInPool(connect("redis://127.0.0.1:1/0"), K.RunKeys("bench"))  # never connects
            app.state.proxy = SessionProxy(pool, http, request_timeout_s=request_timeout_s)
            freeze_startup_objects()
            yield

    return lifespan


def _add_bench_routes(app: FastAPI) -> None:
    """``POST /bench/open/{n}`` and ``POST /bench/close``: open and close the bench's sessions."""
    from shared.protocol import SamplingParams

    sampling = SamplingParams(temperature=0.8, top_p=1.0, max_tokens=GEN_TOKENS)

    @app.post("/bench/open/{n}")
    async def open_sessions(n: int) -> dict[str, int]:
        for i in range(n):
            await app.state.proxy.open(f"s{i}", "train", sampling, env="bench")
        return {"open": len(app.state.proxy.sessions)}

    @app.post("/bench/close")
    async def close_sessions() -> dict[str, int]:
        import gc

        app.state.proxy.sessions.clear()
        gc.collect()
        return {"open": 0}


def gateway_app(upstream_url: str, request_timeout_s: float = 300.0, *, routes_only: bool = False) -> FastAPI:
    """The session routes over a `SessionProxy` whose one generator is ``upstream_url``, with the
    bench's routes to open and close sessions. ``routes_only``: without `SessionCalls` in front
    (every call through the framework's routes), for the comparison row."""
    from fastapi import Depends, FastAPI

    from services.gym_gateway.app import mount_session_routes
    from services.gym_gateway.forwarding import SessionForwarder
    from services.gym_gateway.session_routes import router
    from shared.auth import AuthPolicy
    from shared.http import install_error_handlers, require_agent_token

    app = FastAPI(lifespan=_lifespan(upstream_url, request_timeout_s))
    app.state.auth, app.state.forwarder = AuthPolicy.from_env(False), SessionForwarder("gw-bench")
    install_error_handlers(app)
    if routes_only:
        app.include_router(router, dependencies=[Depends(require_agent_token)])
    else:
        mount_session_routes(app)
    _add_bench_routes(app)
    return app


def serve_gateway(port: int, upstream_url: str, *, routes_only: bool = False) -> None:
    """The bench gateway under uvicorn, with the service's own server settings."""
    import uvicorn

    app = gateway_app(upstream_url, routes_only=routes_only)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=120)
    config.backlog = 8192
    uvicorn.Server(config).run()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve-upstream":
        serve_upstream(int(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "serve-gateway":
        serve_gateway(int(sys.argv[2]), sys.argv[3], routes_only=sys.argv[4:] == ["routes-only"])
    else:
        sys.exit(
            "usage: python -m streamrl.bench.gateway_servers serve-upstream PORT | "
            "serve-gateway PORT UPSTREAM [routes-only]"
        )

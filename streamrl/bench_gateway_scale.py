"""The gateway_scale section of ``streamrl bench``: the session proxy alone, at thousands of sessions.

Three processes on this host, so that only the proxy's own cost separates the two columns:

* a stand-in generator (``serve-upstream``): an aiohttp server that answers every chat call like
  the generator does (the prompt ids, given in full at the top and in the message, the generated
  ids and logprobs, weight versions) after a fixed ``DELAY_S``; the prompt continues the request's
  ``required_prefix_token_ids``, so sessions grow a context as they would against a model;
* the gateway (``serve-gateway``): the gateway's session routes and `SessionProxy` under uvicorn,
  configured as the service configures them, with the stand-in as the one serving generator (no
  Redis, no task worker: sessions are opened through a bench-only route);
* the agents (this process): ``n`` sessions at once, each a conversation of ``TURNS`` timed chat
  calls after one untimed call that opens its connection. All start together and the upstream's
  latency is fixed, so every batch of answers returns at once: the gateway's worst case.

For each size the same conversations also go straight to the stand-in, with the same client code
(the client carries the token history itself, as the proxy does): that column is what the agents
and the stand-in cost on this host. Reported per size: call latency minus ``DELAY_S`` (the
overhead) p50/p99 both ways, the gateway's CPU time per call, and the gateway's memory per open
session (its RSS with every session open and its context grown, minus its RSS before they opened,
over ``n``). Called by `streamrl.bench`.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.child_guard import guarded

if TYPE_CHECKING:
    import aiohttp
    from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Session proxy at scale"
SIZES = (256, 1024, 4096)
DELAY_S = 0.2
TURNS = 3
PROMPT_TOKENS = 2048  # the first prompt: system prompt and tool definitions of an agent
NEW_TOKENS = 64  # tokens each turn adds to the prompt (the tool's output)
GEN_TOKENS = 64  # tokens generated per call


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    """User plus system CPU time of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the stand-in generator -------------------------------------------------------------------


def serve_upstream(port: int) -> None:
    """Answer chat calls like the generator, ``DELAY_S`` after each request arrived."""
    import msgspec
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


def gateway_app(upstream_url: str, request_timeout_s: float = 300.0) -> FastAPI:
    """The session routes over a `SessionProxy` whose one generator is ``upstream_url``, with
    ``POST /bench/open/{n}`` and ``POST /bench/close`` to open and close the bench's sessions."""
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI

    from services.gym_gateway.app import connector
    from services.gym_gateway.forwarding import SessionForwarder
    from services.gym_gateway.proxy import GeneratorPool, SessionProxy
    from services.gym_gateway.session_routes import router
    from shared import keys as K
    from shared.auth import AuthPolicy
    from shared.http import install_error_handlers, require_agent_token
    from shared.protocol import Heartbeat, SamplingParams
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
            yield

    app = FastAPI(lifespan=lifespan)
    app.state.auth, app.state.forwarder = AuthPolicy.from_env(False), SessionForwarder("gw-bench")
    install_error_handlers(app)
    app.include_router(router, dependencies=[Depends(require_agent_token)])
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

    return app


def serve_gateway(port: int, upstream_url: str) -> None:
    """The bench gateway under uvicorn, with the service's own server settings."""
    import uvicorn

    config = uvicorn.Config(
        gateway_app(upstream_url), host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=120
    )
    config.backlog = 8192
    uvicorn.Server(config).run()


# -- the agents -------------------------------------------------------------------------------


async def _conversation(http: aiohttp.ClientSession, url: str, i: int, *, direct: bool) -> list[float] | None:
    """One untimed call, then TURNS timed ones; None on an error."""
    import msgspec

    from shared.openai_api import ChatCompletionResponse

    decoder = msgspec.json.Decoder(ChatCompletionResponse)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Session {i}: count the apples."}]
    context: list[int] = []
    lat: list[float] = []
    for turn in range(TURNS + 1):
        body: dict[str, Any] = {"messages": msgs, "max_tokens": GEN_TOKENS}
        if direct and context:
            body["required_prefix_token_ids"] = context
        t0 = time.perf_counter()
        async with http.post(url, data=msgspec.json.encode(body), headers={"content-type": "application/json"}) as r:
            raw = await r.read()
            if r.status != 200:
                return None
        out = decoder.decode(raw)
        if turn:
            lat.append(time.perf_counter() - t0)
        msg = out.choices[0].message
        context = out.prompt_token_ids + msg.generation_token_ids
        msgs += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": f"Go on ({turn})."}]
    return lat


async def _round(base: str, n: int, *, direct: bool) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        urls = [
            f"{base}/v1/chat/completions" if direct else f"{base}/sessions/s{i}/v1/chat/completions" for i in range(n)
        ]
        results = await asyncio.gather(*(_conversation(http, u, i, direct=direct) for i, u in enumerate(urls)))
    return {"errors": sum(r is None for r in results), "lat": [x for r in results if r for x in r]}


async def _post(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.post(url) as r:
        r.raise_for_status()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


async def _measure(gateway_url: str, upstream_url: str, gateway_pid: int) -> list[dict[str, Any]]:
    rows = []
    await _post(f"{gateway_url}/bench/open/64")  # warm-up: imports, pools, caches
    await _round(gateway_url, 64, direct=False)
    await _post(f"{gateway_url}/bench/close")
    for n in SIZES:
        direct = await _round(upstream_url, n, direct=True)
        rss_before = _rss_kb(gateway_pid)
        await _post(f"{gateway_url}/bench/open/{n}")
        cpu0 = _cpu_s(gateway_pid)
        proxied = await _round(gateway_url, n, direct=False)
        cpu = _cpu_s(gateway_pid) - cpu0
        rss_open = _rss_kb(gateway_pid)
        await _post(f"{gateway_url}/bench/close")
        over = {k: [x - DELAY_S for x in r["lat"]] for k, r in (("proxy", proxied), ("direct", direct))}
        rows.append(
            {
                "sessions": n,
                "calls": len(proxied["lat"]),
                "errors": proxied["errors"] + direct["errors"],
                "overhead_ms": {k: {"p50": _pct(v, 0.5) * 1e3, "p99": _pct(v, 0.99) * 1e3} for k, v in over.items()},
                "cpu_us_per_call": cpu / (n * (TURNS + 1)) * 1e6,
                "memory_per_session_kb": (rss_open - rss_before) / n,
                "load_avg": os.getloadavg()[0],
            }
        )
        print(rows[-1], flush=True)
    return rows


def gateway_scale_benchmark(work: Path, machine: str) -> dict[str, Any]:
    """Start the stand-in and the gateway, measure every size; a JSON-able dict for `render_section`."""
    work.mkdir(parents=True, exist_ok=True)
    up_port, gw_port = _free_port(), _free_port()
    procs = []
    logs = []
    for name, port, extra in (("upstream", up_port, []), ("gateway", gw_port, [f"http://127.0.0.1:{up_port}"])):
        log = open(work / f"{name}.log", "wb")
        logs.append(log)
        cmd = [sys.executable, "-m", "streamrl.bench_gateway_scale", f"serve-{name}", str(port), *extra]
        procs.append(subprocess.Popen(guarded(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    try:
        for port in (up_port, gw_port):
            _wait_port(port)
        up, gw = (f"http://127.0.0.1:{p}" for p in (up_port, gw_port))
        rows = asyncio.run(_measure(gw, up, procs[1].pid))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        for log in logs:
            log.close()
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine, "rows": rows}


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listened on port {port} within {timeout_s:.0f}s")


def render_section(g: dict[str, Any]) -> str:
    target = next((r for r in g["rows"] if r["sessions"] == 1024), None)
    met = target is not None and target["errors"] == 0 and target["overhead_ms"]["proxy"]["p99"] <= 50
    lines = [
        f"{HEADING} (`streamrl bench --only gateway_scale`: the session proxy alone against a stand-in "
        f"generator answering after a fixed {DELAY_S * 1e3:.0f} ms; {TURNS} timed chat calls per session, "
        f"all sessions at once; {g['date']}, {g['machine']})",
        "",
        "| sessions | calls / errors | overhead p50 (ms) | overhead p99 (ms) | direct p50 (ms) | direct p99 (ms) "
        "| gateway CPU per call (us) | memory per open session (KiB) | load average |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in g["rows"]:
        o = r["overhead_ms"]
        lines.append(
            f"| {r['sessions']} | {r['calls']} / {r['errors']} | {o['proxy']['p50']:.1f} | {o['proxy']['p99']:.1f} "
            f"| {o['direct']['p50']:.1f} | {o['direct']['p99']:.1f} | {r['cpu_us_per_call']:.0f} "
            f"| {r['memory_per_session_kb']:.0f} | {r['load_avg']:.1f} |"
        )
    lines += [
        "",
        f"Overhead: an agent's time for a call minus the stand-in's {DELAY_S * 1e3:.0f} ms. Direct: the same "
        "conversations sent straight to the stand-in with the same client code (what the agents and the "
        "stand-in cost on this host, the proxy excluded). Every session's prompt starts at "
        f"{PROMPT_TOKENS} tokens and grows by {NEW_TOKENS + GEN_TOKENS} a call; the stand-in answers with "
        "the prompt ids twice, as the generator does. Gateway CPU per call: the gateway process's "
        "CPU time over the proxied calls of a size (the untimed first ones included). Memory per open "
        "session: the gateway's RSS with every session open after its last call, minus its RSS before "
        "the sessions opened, over the sessions. The agents, the stand-in and the gateway share the "
        "host's cores, and other work ran on it meanwhile (the 1-minute load average is in the table), "
        "so the overheads include waiting for a core. "
        f"Target: p99 overhead <= 50 ms at 1,024 sessions; {'met' if met else 'NOT met'}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve-upstream":
        serve_upstream(int(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "serve-gateway":
        serve_gateway(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: python -m streamrl.bench_gateway_scale serve-upstream PORT | serve-gateway PORT UPSTREAM")

"""The gateway_scale section of ``streamrl bench``: the session proxy alone, at thousands of sessions.

Four processes on this host, so that only the proxy's own cost separates the columns: a stand-in
generator answering after a fixed ``DELAY_S``, the gateway (its session routes, `SessionCalls`
and `SessionProxy` as the service configures them, start-up objects frozen out of the collector
too), a second gateway without `SessionCalls` for the comparison rows at 1,024 sessions (these
three: `streamrl.bench.gateway_servers`), and the agents (this process): ``n`` sessions at once,
each a conversation of ``TURNS`` timed chat calls after one untimed call that opens its
connection. Two traffics: *burst*, every call at once, so (the upstream's latency being fixed)
every batch of answers returns at once, the gateway's worst case; *steady*, an exponential pause
of mean ``THINK_S`` before each call (the agent running its tool), so sessions drift apart as in
an agentic run.

The gateways are pinned to one core, the stand-in and the agents to the others. For each size
the same conversations (same pauses) also go straight to the stand-in with the same client code
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

import msgspec

from streamrl.child_guard import guarded

if TYPE_CHECKING:
    import aiohttp

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Session proxy at scale"
SIZES = (256, 1024, 4096)
DELAY_S = 0.2
TURNS = 3
THINK_S = 2.0  # steady traffic: mean of the exponential pause before each call (the agent's tool run)
SCENARIOS = ("burst", "steady")
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


# -- the agents -------------------------------------------------------------------------------


class _Message(msgspec.Struct):
    content: str
    generation_token_ids: msgspec.Raw


class _Choice(msgspec.Struct):
    message: _Message


class _Answer(msgspec.Struct):
    """What an agent reads of an answer: the text, and (going direct) the ids it carries back
    as its context, kept as their JSON; the rest is skipped unparsed."""

    choices: list[_Choice]
    prompt_token_ids: msgspec.Raw


_answers = msgspec.json.Decoder(_Answer)


async def _conversation(
    http: aiohttp.ClientSession, url: str, i: int, *, direct: bool, think: random.Random | None
) -> list[float] | None:
    """One untimed call, then TURNS timed ones; None on an error. With ``think``, each call waits an
    exponential pause of mean THINK_S first (steady traffic); without, every call goes at once.
    The agents are as light as a client can be (their cost lands in both columns): going direct,
    the context goes back as the answer's id arrays spliced as JSON, never decoded."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Session {i}: count the apples."}]
    context = b""
    lat: list[float] = []
    for turn in range(TURNS + 1):
        if think is not None:
            await asyncio.sleep(think.expovariate(1 / THINK_S))
        body: dict[str, Any] = {"messages": msgs, "max_tokens": GEN_TOKENS}
        if direct and context:
            body["required_prefix_token_ids"] = msgspec.Raw(context)
        t0 = time.perf_counter()
        async with http.post(url, data=msgspec.json.encode(body), headers={"content-type": "application/json"}) as r:
            raw = await r.read()
            if r.status != 200:
                return None
        out = _answers.decode(raw)
        if turn:
            lat.append(time.perf_counter() - t0)
        msg = out.choices[0].message
        if direct:  # "[p1,...,pn" + "," + "g1,...,gm]"
            context = bytes(out.prompt_token_ids)[:-1] + b"," + bytes(msg.generation_token_ids)[1:]
        msgs += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": f"Go on ({turn})."}]
    return lat


async def _round(base: str, n: int, *, direct: bool, steady: bool = False) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(n)  # the same pauses for the proxied and the direct round of a size

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        urls = [
            f"{base}/v1/chat/completions" if direct else f"{base}/sessions/s{i}/v1/chat/completions" for i in range(n)
        ]
        results = await asyncio.gather(
            *(
                _conversation(http, u, i, direct=direct, think=random.Random(rng.random()) if steady else None)
                for i, u in enumerate(urls)
            )
        )
    return {"errors": sum(r is None for r in results), "lat": [x for r in results if r for x in r]}


async def _post(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.post(url) as r:
        r.raise_for_status()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


async def _measure_round(
    gateway: tuple[str, int], upstream_url: str, scenario: str, n: int, label: str | None = None
) -> dict[str, Any]:
    """One size of one traffic: the direct round, then the proxied round through ``gateway``
    (its URL and pid)."""
    url, pid = gateway
    steady = scenario == "steady"
    direct = await _round(upstream_url, n, direct=True, steady=steady)
    rss_before = _rss_kb(pid)
    await _post(f"{url}/bench/open/{n}")
    cpu0 = _cpu_s(pid)
    proxied = await _round(url, n, direct=False, steady=steady)
    cpu = _cpu_s(pid) - cpu0
    rss_open = _rss_kb(pid)
    await _post(f"{url}/bench/close")
    over = {k: [x - DELAY_S for x in r["lat"]] for k, r in (("proxy", proxied), ("direct", direct))}
    row = {
        "scenario": label or scenario,
        "sessions": n,
        "calls": len(proxied["lat"]),
        "errors": proxied["errors"] + direct["errors"],
        "overhead_ms": {k: {"p50": _pct(v, 0.5) * 1e3, "p99": _pct(v, 0.99) * 1e3} for k, v in over.items()},
        "cpu_us_per_call": cpu / (n * (TURNS + 1)) * 1e6,
        # a burst holds every session's grown context at once; steady rounds reuse its memory
        "memory_per_session_kb": None if steady else (rss_open - rss_before) / n,
        "load_avg": os.getloadavg()[0],
    }
    print(row, flush=True)
    return row


async def _measure(gateway: tuple[str, int], routes_only: tuple[str, int], upstream_url: str) -> list[dict[str, Any]]:
    for url, _ in (gateway, routes_only):  # warm-up: imports, pools, caches
        await _post(f"{url}/bench/open/64")
        await _round(url, 64, direct=False)
        await _post(f"{url}/bench/close")
    rows = [await _measure_round(gateway, upstream_url, scenario, n) for scenario in SCENARIOS for n in SIZES]
    for scenario in SCENARIOS:  # the same rounds at 1,024 sessions through the framework's routes
        rows.append(await _measure_round(routes_only, upstream_url, scenario, 1024, f"{scenario}, routes only"))
    return rows


def _pin(gateway_pids: list[int], others: list[int]) -> str:
    """The gateway on a core of its own, the stand-in and the agents (this process) on the rest,
    so that neither side's queue holds up the other's CPU; a description for the report."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "all processes on one core"
    for pid in gateway_pids:
        os.sched_setaffinity(pid, {cpus[-1]})
    for pid in (*others, 0):
        os.sched_setaffinity(pid, set(cpus[:-1]))
    rest = "core" if len(cpus) == 2 else f"{len(cpus) - 1} cores"
    return f"the gateway pinned to a core of its own, the agents and the stand-in to the other {rest}"


def gateway_scale_benchmark(work: Path, machine: str) -> dict[str, Any]:
    """Start the stand-in and the gateway, measure every size; a JSON-able dict for `render_section`."""
    work.mkdir(parents=True, exist_ok=True)
    up_port, gw_port, routes_port = _free_port(), _free_port(), _free_port()
    up = f"http://127.0.0.1:{up_port}"
    procs = []
    logs = []
    for name, port, extra in (
        ("upstream", up_port, []),
        ("gateway", gw_port, [up]),
        ("gateway", routes_port, [up, "routes-only"]),
    ):
        log = open(work / f"{name}-{port}.log", "wb")
        logs.append(log)
        cmd = [sys.executable, "-m", "streamrl.bench.gateway_servers", f"serve-{name}", str(port), *extra]
        procs.append(subprocess.Popen(guarded(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    affinity = os.sched_getaffinity(0)
    try:
        for port in (up_port, gw_port, routes_port):
            _wait_port(port)
        placement = _pin([procs[1].pid, procs[2].pid], [procs[0].pid])
        gw, routes = ((f"http://127.0.0.1:{port}", p.pid) for port, p in ((gw_port, procs[1]), (routes_port, procs[2])))
        rows = asyncio.run(_measure(gw, routes, up))
    finally:
        os.sched_setaffinity(0, affinity)
        for p in procs:
            p.terminate()
            p.wait(30)
        for log in logs:
            log.close()
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine, "placement": placement, "rows": rows}


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
    def p99(scenario: str, n: int) -> float | None:
        row = next((r for r in g["rows"] if r.get("scenario", "burst") == scenario and r["sessions"] == n), None)
        return row["overhead_ms"]["proxy"]["p99"] if row is not None and row["errors"] == 0 else None

    steady, burst = p99("steady", 1024), p99("burst", 1024)
    met = steady is not None and steady <= 50
    lines = [
        f"{HEADING} (`streamrl bench --only gateway_scale`: the session proxy alone against a stand-in "
        f"generator answering after a fixed {DELAY_S * 1e3:.0f} ms; {TURNS} timed chat calls per session; "
        f"{g.get('placement', 'no pinning')}; {g['date']}, {g['machine']})",
        "",
        "| traffic | sessions | calls / errors | overhead p50 (ms) | overhead p99 (ms) | direct p50 (ms) "
        "| direct p99 (ms) | gateway CPU per call (us) | memory per open session (KiB) | load average |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in g["rows"]:
        o = r["overhead_ms"]
        lines.append(
            f"| {r.get('scenario', 'burst')} | {r['sessions']} | {r['calls']} / {r['errors']} "
            f"| {o['proxy']['p50']:.1f} | {o['proxy']['p99']:.1f} | {o['direct']['p50']:.1f} "
            f"| {o['direct']['p99']:.1f} | {r['cpu_us_per_call']:.0f} | {_kib(r['memory_per_session_kb'])} "
            f"| {r['load_avg']:.1f} |"
        )
    lines += ["", *_fast_path_lines(g["rows"])]
    lines += [
        "Traffic: *burst*, every session calls at once and the stand-in's latency is fixed, so every "
        "batch of answers returns at once (the gateway's worst case); *steady*, each call waits an "
        f"exponential pause of mean {THINK_S:.0f} s first (the agent running its tool), as sessions of "
        "an agentic run drift apart. Overhead: an agent's time for a call minus the stand-in's "
        f"{DELAY_S * 1e3:.0f} ms. Direct: the same conversations (same pauses) sent straight to the "
        "stand-in with the same client code: what the agents and the stand-in cost, the proxy excluded. "
        f"Every session's prompt starts at {PROMPT_TOKENS} tokens and grows by {NEW_TOKENS + GEN_TOKENS} "
        "a call; the stand-in answers with the prompt ids twice, as the generator does. Gateway CPU per "
        "call: the gateway process's CPU time over the proxied calls of a size (the untimed first ones "
        "included). Memory per open session: the gateway's RSS with every session open after its last "
        "call, minus its RSS before the sessions opened, over the sessions (burst rounds only: a "
        "steady round reuses what the burst before it freed). Where the direct p50 is far above zero, "
        "the core of the agents and the stand-in was saturated and the row measures this host more "
        "than the proxy. In a burst the last answer of n waits for the gateway's work on the n - 1 "
        "before it on one event loop, so its p99 is about n times the CPU per call, whatever the code: "
        "a burst of 1,024 within 50 ms needs under 50 us a call, or the sessions spread over more "
        "gateway workers (`gym_gateway.num_workers`, `streamrl scale gym-gateway=N`), one a core. "
        f"Target: p99 overhead <= 50 ms at 1,024 sessions: steady traffic {_verdict(steady)}, "
        f"burst {_verdict(burst)}; {'met' if met else 'NOT met'} for an agentic run's traffic.",
        "",
    ]
    return "\n".join(lines)


def _fast_path_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The held sessions' calls answered in front of the framework against the same rounds through
    the framework's routes alone (a second gateway process on the same core, same run)."""
    out = []
    for scenario in SCENARIOS:
        fast = next((r for r in rows if r.get("scenario") == scenario and r["sessions"] == 1024), None)
        slow = next((r for r in rows if r.get("scenario") == f"{scenario}, routes only"), None)
        if fast is None or slow is None:
            continue
        f, w = fast["cpu_us_per_call"], slow["cpu_us_per_call"]
        fp, wp = fast["overhead_ms"]["proxy"]["p99"], slow["overhead_ms"]["proxy"]["p99"]
        out.append(
            f"- {scenario}, 1,024 sessions: gateway CPU per call {f:.0f} us answered in front of the framework "
            f"(`SessionCalls`) against {w:.0f} us through the framework's routes alone ({f / w:.2f}x); "
            f"overhead p99 {fp:.1f} against {wp:.1f} ms."
        )
    return [*out, ""] if out else []


def _kib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _verdict(p99: float | None) -> str:
    return "not measured" if p99 is None else f"{p99:.0f} ms ({'met' if p99 <= 50 else 'not met'})"

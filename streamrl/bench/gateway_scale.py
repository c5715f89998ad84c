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
over ``n``). `gateway_scale_benchmark` returns the section's `ScaleResults`, rendered by
``templates/gateway_scale.md.jinja``. Called by `streamrl.bench.suite`.
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
from typing import TYPE_CHECKING

import msgspec

from streamrl.bench.report import Results, render
from streamrl.child_guard import guarded

if TYPE_CHECKING:
    import aiohttp

ROOT = Path(__file__).resolve().parents[2]
SIZES = (256, 1024, 4096)
DELAY_S = 0.2
TURNS = 3
THINK_S = 2.0  # steady traffic: mean of the exponential pause before each call (the agent's tool run)
SCENARIOS = ("burst", "steady")
PROMPT_TOKENS = 2048  # the first prompt: system prompt and tool definitions of an agent
NEW_TOKENS = 64  # tokens each turn adds to the prompt (the tool's output)
GEN_TOKENS = 64  # tokens generated per call
TARGET_P99_MS = 50.0  # proxy overhead p99 at TARGET_SESSIONS, steady traffic
TARGET_SESSIONS = 1024


class ScaleRow(msgspec.Struct):
    """One traffic at one size: the proxy's overhead (call latency minus DELAY_S, ms) through the
    gateway and going direct, the gateway's CPU per call and memory per open session."""

    scenario: str  # "burst", "steady", "<traffic>, routes only"
    sessions: int
    calls: int
    errors: int  # both ways
    proxy_p50_ms: float | None
    proxy_p99_ms: float | None
    direct_p50_ms: float | None
    direct_p99_ms: float | None
    cpu_us_per_call: float
    memory_per_session_kb: float | None  # burst rounds only (a steady round reuses what the burst freed)
    load_avg: float


class FastPath(msgspec.Struct):
    """At TARGET_SESSIONS, one traffic answered in front of the framework (`SessionCalls`) against
    the framework's routes alone (a second gateway process on the same core, same run)."""

    scenario: str
    cpu_us_per_call: float
    routes_cpu_us_per_call: float
    ratio: float
    p99_ms: float | None
    routes_p99_ms: float | None


class ScaleResults(Results):
    date: str
    machine: str
    placement: str  # how the processes were pinned to cores
    rows: list[ScaleRow]
    fast_path: list[FastPath]
    steady_p99_ms: float | None  # the target's figure; None when not measured or with errors
    burst_p99_ms: float | None


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
    msgs: list[dict[str, str]] = [{"role": "user", "content": f"Session {i}: count the apples."}]
    context = b""
    lat: list[float] = []
    for turn in range(TURNS + 1):
        if think is not None:
            await asyncio.sleep(think.expovariate(1 / THINK_S))
        body: dict[str, object] = {"messages": msgs, "max_tokens": GEN_TOKENS}
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


async def _round(base: str, n: int, *, direct: bool, steady: bool = False) -> tuple[int, list[float]]:
    """``n`` conversations at once through ``base``; (errors, timed call latencies)."""
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
    return sum(r is None for r in results), [x for r in results if r for x in r]


async def _post(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.post(url) as r:
        r.raise_for_status()


def _pct_ms(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (seconds) minus DELAY_S, in ms."""
    s = sorted(xs)
    return (s[min(len(s) - 1, int(round(q * (len(s) - 1))))] - DELAY_S) * 1e3 if s else None


async def _measure_round(
    gateway: tuple[str, int], upstream_url: str, scenario: str, n: int, label: str | None = None
) -> ScaleRow:
    """One size of one traffic: the direct round, then the proxied round through ``gateway``
    (its URL and pid)."""
    url, pid = gateway
    steady = scenario == "steady"
    direct_errors, direct = await _round(upstream_url, n, direct=True, steady=steady)
    rss_before = _rss_kb(pid)
    await _post(f"{url}/bench/open/{n}")
    cpu0 = _cpu_s(pid)
    errors, proxied = await _round(url, n, direct=False, steady=steady)
    cpu = _cpu_s(pid) - cpu0
    rss_open = _rss_kb(pid)
    await _post(f"{url}/bench/close")
    row = ScaleRow(
        scenario=label or scenario,
        sessions=n,
        calls=len(proxied),
        errors=errors + direct_errors,
        proxy_p50_ms=_pct_ms(proxied, 0.5),
        proxy_p99_ms=_pct_ms(proxied, 0.99),
        direct_p50_ms=_pct_ms(direct, 0.5),
        direct_p99_ms=_pct_ms(direct, 0.99),
        cpu_us_per_call=cpu / (n * (TURNS + 1)) * 1e6,
        # a burst holds every session's grown context at once; steady rounds reuse its memory
        memory_per_session_kb=None if steady else (rss_open - rss_before) / n,
        load_avg=os.getloadavg()[0],
    )
    print(row, flush=True)
    return row


async def _measure(gateway: tuple[str, int], routes_only: tuple[str, int], upstream_url: str) -> list[ScaleRow]:
    for url, _ in (gateway, routes_only):  # warm-up: imports, pools, caches
        await _post(f"{url}/bench/open/64")
        await _round(url, 64, direct=False)
        await _post(f"{url}/bench/close")
    rows = [await _measure_round(gateway, upstream_url, scenario, n) for scenario in SCENARIOS for n in SIZES]
    for scenario in SCENARIOS:  # the same rounds at 1,024 sessions through the framework's routes
        label = f"{scenario}, routes only"
        rows.append(await _measure_round(routes_only, upstream_url, scenario, TARGET_SESSIONS, label))
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


def gateway_scale_benchmark(work: Path, machine: str) -> ScaleResults:
    """Start the stand-in and the gateway, measure every size."""
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
    return summarize(rows, date=time.strftime("%Y-%m-%d"), machine=machine, placement=placement)


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listened on port {port} within {timeout_s:.0f}s")


def _row(rows: list[ScaleRow], scenario: str) -> ScaleRow | None:
    """The row of ``scenario`` at TARGET_SESSIONS."""
    return next((r for r in rows if r.scenario == scenario and r.sessions == TARGET_SESSIONS), None)


def _target_p99(rows: list[ScaleRow], scenario: str) -> float | None:
    row = _row(rows, scenario)
    return row.proxy_p99_ms if row is not None and row.errors == 0 else None


def _fast_path(rows: list[ScaleRow]) -> list[FastPath]:
    out = []
    for scenario in SCENARIOS:
        fast, slow = _row(rows, scenario), _row(rows, f"{scenario}, routes only")
        if fast is None or slow is None:
            continue
        f, w = fast.cpu_us_per_call, slow.cpu_us_per_call
        out.append(FastPath(scenario, f, w, f / w, fast.proxy_p99_ms, slow.proxy_p99_ms))
    return out


def summarize(rows: list[ScaleRow], *, date: str, machine: str, placement: str) -> ScaleResults:
    """The section's figures from every round's row."""
    return ScaleResults(
        date=date,
        machine=machine,
        placement=placement,
        rows=rows,
        fast_path=_fast_path(rows),
        steady_p99_ms=_target_p99(rows, "steady"),
        burst_p99_ms=_target_p99(rows, "burst"),
    )


def render_section(r: ScaleResults) -> str:
    return render(
        "gateway_scale",
        r=r,
        delay_ms=DELAY_S * 1e3,
        turns=TURNS,
        think_s=THINK_S,
        prompt_tokens=PROMPT_TOKENS,
        growth_tokens=NEW_TOKENS + GEN_TOKENS,
        target_ms=TARGET_P99_MS,
        target_sessions=TARGET_SESSIONS,
    )

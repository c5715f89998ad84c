"""Generator throughput, side by side: our HTTP layer against the raw vLLM ``AsyncLLM`` engine.

HTTP: POST /v1/chat/completions on a real ``python -m services.generator`` process (vLLM backend),
sent with aiohttp as the gateway sends them. Raw: vLLM's ``AsyncLLM`` built from the engine args
and sampling parameters `services.generator.vllm_engine` builds, fed the same prompt ids
(``TokensPrompt``), seeds and max_tokens, in a process of its own (``python -m
streamrl.bench.raw_engine``, which writes its rounds as JSON).

Only one engine is alive at a time. vLLM on CPU pins every engine's worker to the same cores and
its worker and engine-core processes busy-wait for a second after each step; a second, idle
engine kept alive next to the measured one shares those cores and, seen on 2 cores, starved the
measured side's processes for seconds at a time (a GET /admin/state took 8-27 s, a round ran 5-10x
slower), which is a property of the bench, not of either side. So the run is split in blocks, each
starting one side's engine, running ``ROUNDS_PER_BLOCK`` rounds at every concurrency and stopping
it; blocks alternate raw, HTTP, HTTP, raw, ... so drift of the machine hits both sides. The k-th
round of a side at a concurrency sends the same requests on both sides, and the ratio is the
median of the per-round ratios. Generated tokens are counted from the responses on both sides.
Also reported: CPU time per request outside the engine processes (the raw front end; the
generator's API process and the HTTP client).

Called by `streamrl.bench.generator`; its figures go into `GeneratorResults` as `Throughput`.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import aiohttp

    from services.generator.chat import ChatRenderer
    from streamrl.bench.generator_process import GeneratorProcess

ROOT = Path(__file__).resolve().parents[2]
CONCURRENCY = (1, 16, 64)
BLOCKS = 4  # per side; one engine start each
ROUNDS_PER_BLOCK = 2
MAX_TOKENS = 64
PROMPT_WORDS = 16
REQUESTS_PER_WORKER = 4  # per round; at least MIN_REQUESTS
MIN_REQUESTS = 8
WARM_REQUESTS = 2 * max(CONCURRENCY)
_WORDS = "the answer number tool call value sum river city apple red blue one two three please use compute".split()


@dataclass(frozen=True)
class BenchRequest:
    """One chat request, identical on both sides: the HTTP body's messages and seed, and the
    prompt ids the generator renders them to (what the raw engine is fed)."""

    messages: list[dict[str, str]]
    prompt_ids: list[int]
    seed: int


class RawRound(msgspec.Struct):
    """One measured round of the raw engine (its own process)."""

    round: int
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    cpu_s: float  # the AsyncLLM front end's (this process)
    load_avg: float


class HttpRound(msgspec.Struct):
    """One measured round through the generator's HTTP API."""

    round: int
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float  # the generator's API process
    load_avg: float


class RoundPair(msgspec.Struct):
    """The raw and the HTTP round that sent the same requests."""

    requests: int
    raw_tokens: int
    raw_s: float
    http_tokens: int
    http_s: float
    raw_frontend_cpu_s: float
    http_client_cpu_s: float
    http_server_cpu_s: float
    load_avg: float  # the larger of the two rounds'


class ConcurrencyRow(msgspec.Struct):
    """Both sides at one concurrency: medians of the rounds, and of the per-round ratios."""

    concurrency: int
    raw_tok_s: float
    http_tok_s: float
    ratio: float  # HTTP / raw
    ratio_min: float
    ratio_max: float
    raw_tokens: int  # all rounds
    http_tokens: int
    raw_frontend_cpu_ms_per_request: float
    http_server_cpu_ms_per_request: float
    http_client_cpu_ms_per_request: float


class Throughput(msgspec.Struct):
    rows: list[ConcurrencyRow]
    load_avg_min: float  # 1-minute load average over the rounds
    load_avg_max: float


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def make_requests(renderer: ChatRenderer, n: int, seed: int) -> list[BenchRequest]:
    """``n`` one-message conversations of PROMPT_WORDS random words (24 tokens with the tiny
    tokenizer: shorter than one KV block, so no prefix-cache hits, and short enough that 64 new
    prompts fit one scheduler step, see `check_no_chunked_prefill`)."""
    import msgspec

    from shared.openai_api import ChatMessage

    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": words(rng, PROMPT_WORDS)}]
        prompt = renderer.chat_prompt(msgspec.convert(messages, list[ChatMessage]))
        out.append(BenchRequest(messages, prompt.prompt_ids, seed * 1000 + i))
    return out


def round_plan() -> list[tuple[int, int, int]]:
    """(round index, concurrency, seed) of every measured round of one block, in order; both
    sides of a block pair run the same plan."""
    return [(r, c, 100 * (r + 1) + c) for r in range(ROUNDS_PER_BLOCK) for c in CONCURRENCY]


def request_count(concurrency: int) -> int:
    return max(MIN_REQUESTS, concurrency * REQUESTS_PER_WORKER)


def check_no_chunked_prefill(requests: list[BenchRequest], concurrency: int, max_batched_tokens: int) -> None:
    """Refuse prompts that could be prefilled in chunks: vLLM on CPU rewinds a seeded request's
    torch generator after a partial prefill, which CPU generators do not support, and the engine
    dies ("CPU Generator does not use offset"). The bench sends seeds, so every step must fit."""
    worst = concurrency * (max(len(r.prompt_ids) for r in requests) + 1)
    if worst > max_batched_tokens:
        raise ValueError(
            f"{concurrency} prompts of up to {worst // concurrency - 1} tokens may exceed the "
            f"engine's {max_batched_tokens} tokens per step and be prefilled in chunks"
        )


async def closed_loop(
    requests: list[BenchRequest], concurrency: int, one: Callable[[BenchRequest], Awaitable[int]]
) -> tuple[int, float]:
    """``concurrency`` workers send ``requests`` back to back; (generated tokens, seconds)."""
    it: Iterator[BenchRequest] = iter(requests)
    total = 0

    async def worker() -> None:
        nonlocal total
        for req in it:
            tokens = await one(req)  # not ``total += await ...``: that reads total before awaiting
            total += tokens

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return total, time.perf_counter() - t0


# -- raw side (its own process, `streamrl.bench.raw_engine`) ---------------------------------


def run_raw_block(config: Path, out: Path, log_path: Path, timeout_s: float = 900.0) -> list[RawRound]:
    """One raw block in a fresh ``python -m streamrl.bench.raw_engine`` process; its rounds."""
    cmd = [sys.executable, "-m", "streamrl.bench.raw_engine", str(config), str(out)]
    with open(log_path, "ab") as log:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    if proc.returncode != 0:
        raise RuntimeError(f"raw engine block exited with {proc.returncode}; see {log_path}")
    return msgspec.json.decode(out.read_bytes(), type=list[RawRound])


# -- HTTP side ---------------------------------------------------------------------------------


async def http_one(session: aiohttp.ClientSession, url: str, req: BenchRequest, *, check_prompt: bool = False) -> int:
    """One POST /v1/chat/completions; the generated tokens of its response."""
    import msgspec

    from shared.openai_api import ChatCompletionResponse

    body = msgspec.json.encode({"messages": req.messages, "max_tokens": MAX_TOKENS, "seed": req.seed})
    async with session.post(f"{url}/v1/chat/completions", data=body, headers={"content-type": "application/json"}) as r:
        raw = await r.read()
        if r.status != 200:
            raise RuntimeError(f"generator answered {r.status}: {raw[:500]!r}")
    resp = msgspec.json.decode(raw, type=ChatCompletionResponse)
    if check_prompt and resp.prompt_token_ids != req.prompt_ids:
        raise RuntimeError("the generator rendered a different prompt than the raw engine is fed")
    return sum(len(c.message.generation_token_ids) for c in resp.choices)


async def _http_block(renderer: ChatRenderer, start: Callable[[], GeneratorProcess]) -> list[HttpRound]:
    import aiohttp
    import psutil  # a dependency of vLLM

    gen = start()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
        ) as session:
            await gen.wait_ready(session)
            server = psutil.Process(gen.proc.pid)

            def server_cpu() -> float:
                t = server.cpu_times()
                cpu_s: float = t.user + t.system
                return cpu_s

            warm = make_requests(renderer, WARM_REQUESTS, seed=1)
            await closed_loop(warm, max(CONCURRENCY), lambda r: http_one(session, gen.url, r, check_prompt=True))
            rounds = []
            for rnd, c, seed in round_plan():
                reqs = make_requests(renderer, request_count(c), seed)
                cpu0, srv0 = time.process_time(), server_cpu()
                tokens, seconds = await closed_loop(reqs, c, lambda r: http_one(session, gen.url, r))
                client_s, server_s = time.process_time() - cpu0, server_cpu() - srv0
                rounds.append(HttpRound(rnd, c, len(reqs), tokens, seconds, client_s, server_s, os.getloadavg()[0]))
            return rounds
    finally:
        gen.stop()


def pair_rounds(raw: list[RawRound], http: list[HttpRound]) -> dict[int, list[RoundPair]]:
    """Raw and HTTP rounds of one block pair matched by (round, concurrency), grouped by concurrency."""
    by_key = {(r.round, r.concurrency): r for r in raw}
    rows: dict[int, list[RoundPair]] = {}
    for h in http:
        r = by_key[(h.round, h.concurrency)]
        rows.setdefault(h.concurrency, []).append(
            RoundPair(
                requests=h.requests,
                raw_tokens=r.tokens,
                raw_s=r.seconds,
                http_tokens=h.tokens,
                http_s=h.seconds,
                raw_frontend_cpu_s=r.cpu_s,
                http_client_cpu_s=h.client_cpu_s,
                http_server_cpu_s=h.server_cpu_s,
                load_avg=max(r.load_avg, h.load_avg),
            )
        )
    return rows


def throughput(
    config: Path, renderer: ChatRenderer, start_generator: Callable[[], GeneratorProcess], work: Path
) -> Throughput:
    """``BLOCKS`` block pairs, raw and HTTP alternating in ABBA order; medians per concurrency."""
    from services.generator.app import freeze_startup_heap

    freeze_startup_heap()  # the client side: this process's heap, as in every HTTP block
    rows: dict[int, list[RoundPair]] = {c: [] for c in CONCURRENCY}
    for block in range(BLOCKS):
        raw: list[RawRound] = []
        http: list[HttpRound] = []
        for side in ("raw", "http") if block % 2 == 0 else ("http", "raw"):
            if side == "raw":
                raw = run_raw_block(config, work / f"raw-{block}.json", work / "raw-engine.log")
            else:
                http = asyncio.run(_http_block(renderer, start_generator))
        for c, rs in pair_rounds(raw, http).items():
            rows[c].extend(rs)
    return summarize_throughput(rows)


def summarize_throughput(rows: dict[int, list[RoundPair]]) -> Throughput:
    """Every concurrency's row, and the range of the load average over all rounds."""
    loads = [r.load_avg for rs in rows.values() for r in rs]
    return Throughput([summarize_rounds(c, rs) for c, rs in rows.items()], min(loads), max(loads))


def _cpu_ms(rounds: list[RoundPair], cpu_s: Callable[[RoundPair], float]) -> float:
    return statistics.median(1e3 * cpu_s(r) / r.requests for r in rounds)


def summarize_rounds(concurrency: int, rounds: list[RoundPair]) -> ConcurrencyRow:
    """Median tokens/s of each side, the median (and range) of the per-round HTTP/raw ratios, CPU per request."""
    raw = [r.raw_tokens / r.raw_s for r in rounds]
    http = [r.http_tokens / r.http_s for r in rounds]
    ratios = [h / r for h, r in zip(http, raw, strict=True)]
    return ConcurrencyRow(
        concurrency=concurrency,
        raw_tok_s=statistics.median(raw),
        http_tok_s=statistics.median(http),
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        raw_tokens=sum(r.raw_tokens for r in rounds),
        http_tokens=sum(r.http_tokens for r in rounds),
        raw_frontend_cpu_ms_per_request=_cpu_ms(rounds, lambda r: r.raw_frontend_cpu_s),
        http_server_cpu_ms_per_request=_cpu_ms(rounds, lambda r: r.http_server_cpu_s),
        http_client_cpu_ms_per_request=_cpu_ms(rounds, lambda r: r.http_client_cpu_s),
    )

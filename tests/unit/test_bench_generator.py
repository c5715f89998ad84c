"""The generator benchmark's pure parts: the rendered tables, round summaries, the closed-loop
driver's token count and the chunked-prefill guard. (Where the section goes in BENCHMARKS.md:
tests/unit/test_bench_suite.py.)"""

import asyncio

import pytest

from streamrl.bench.generator import GeneratorResults, refit_figures, render_section, splice_row
from streamrl.bench.throughput import (
    BenchRequest,
    HttpRound,
    RawRound,
    RoundPair,
    check_no_chunked_prefill,
    closed_loop,
    pair_rounds,
    round_plan,
    summarize_rounds,
    summarize_throughput,
)

pytestmark = pytest.mark.unit


def _round(raw_s: float, http_s: float) -> RoundPair:
    return RoundPair(
        requests=4,
        raw_tokens=256,
        raw_s=raw_s,
        http_tokens=256,
        http_s=http_s,
        raw_frontend_cpu_s=0.004,
        http_client_cpu_s=0.002,
        http_server_cpu_s=0.008,
        load_avg=1.5,
    )


def _results(ratio_16: float) -> GeneratorResults:
    rounds = {1: [_round(1.0, 1.0)], 16: [_round(1.0, 1.0 / ratio_16)], 64: [_round(1.0, 1.0)]}
    return GeneratorResults(
        date="2026-01-01",
        machine="x86_64, 2 cores",
        max_tokens=64,
        prompt_tokens=24,
        blocks=1,
        rounds_per_block=1,
        throughput=summarize_throughput(rounds),
        splice=[splice_row("short", 3, 400, spliced_us=2000.0, plain_us=1000.0)],
        refit=refit_figures([(0.08, 0.07)] * 5, baseline=[0.01] * 5, num_bytes=4 * 2**20),
    )


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_summary_ratio_is_the_median_of_per_round_ratios():
    s = summarize_rounds(16, [_round(1.0, 2.0), _round(2.0, 2.0), _round(1.0, 1.25)])
    assert (s.ratio, s.ratio_min, s.ratio_max) == pytest.approx((0.8, 0.5, 1.0))
    assert s.raw_tok_s == pytest.approx(256.0) and s.http_tok_s == pytest.approx(128.0)
    assert (s.raw_tokens, s.http_tokens) == (768, 768)
    assert s.http_server_cpu_ms_per_request == pytest.approx(2.0)


def test_rendered_section_reports_target_and_tables():
    text = render_section(_results(ratio_16=0.96))
    assert text.startswith("## Generator\n")
    assert "| 16 | 256 | 246 | 0.96 (0.96-0.96) | 256 / 256 | 1.0 / 2.0 + 0.5 |" in text
    assert "at 16 and 64 concurrent requests: met." in _flat(text)
    assert "| short: 3 turns | 400 | 2000 | 1000 | 1000 | 2.00 |" in text
    assert "Refit over baseline: 8.0x." in text
    assert "load average ranged 1.5-1.5" in _flat(text)
    assert "not met." in render_section(_results(ratio_16=0.90))


def test_closed_loop_counts_every_request_under_concurrency():
    async def one(req: BenchRequest) -> int:
        await asyncio.sleep(0)
        return req.seed

    reqs = [BenchRequest([], [1], seed=i) for i in range(100)]
    tokens, seconds = asyncio.run(closed_loop(reqs, 16, one))
    assert tokens == sum(range(100)) and seconds >= 0


def test_chunked_prefill_guard():
    reqs = [BenchRequest([], list(range(24)), seed=0)]
    check_no_chunked_prefill(reqs, 64, 2048)
    with pytest.raises(ValueError, match="prefilled in chunks"):
        check_no_chunked_prefill(reqs, 64, 1024)


def test_rounds_are_paired_by_round_and_concurrency_not_by_order():
    plan = round_plan()
    assert len({(r, c) for r, c, _ in plan}) == len(plan) and len({s for _, _, s in plan}) == len(plan)
    raw = [
        RawRound(round=r, concurrency=c, requests=8, tokens=100 * c + r, seconds=1.0, cpu_s=0.01, load_avg=1.0)
        for r, c, _ in plan
    ]
    http = [
        HttpRound(
            round=r,
            concurrency=c,
            requests=8,
            tokens=100 * c + r,
            seconds=2.0,
            client_cpu_s=0.0,
            server_cpu_s=0.02,
            load_avg=3.0,
        )
        for r, c, _ in reversed(plan)
    ]
    rows = pair_rounds(raw, http)
    assert sorted(rows) == sorted({c for _, c, _ in plan})
    for c, rs in rows.items():
        assert all(row.raw_tokens == row.http_tokens for row in rs)
        assert summarize_rounds(c, rs).ratio == pytest.approx(0.5)
        assert {row.load_avg for row in rs} == {3.0}

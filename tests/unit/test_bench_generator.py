"""The generator benchmark's pure parts: section replacement in BENCHMARKS.md, the rendered tables,
round summaries, the closed-loop driver's token count and the chunked-prefill guard."""

import asyncio

import pytest

from streamrl.bench.generator import HEADING, render_section, replace_section
from streamrl.bench.throughput import (
    BenchRequest,
    check_no_chunked_prefill,
    closed_loop,
    pair_rounds,
    round_plan,
    summarize_rounds,
)

pytestmark = pytest.mark.unit

DOC = "# Benchmarks\n\nintro\n\n## Demo run\n\n| a |\n\n## Stream transport\n\nstreams text\n"


def _round(raw_s: float, http_s: float) -> dict:
    return {
        "requests": 4,
        "raw_tokens": 256,
        "raw_s": raw_s,
        "http_tokens": 256,
        "http_s": http_s,
        "raw_frontend_cpu_s": 0.004,
        "http_server_cpu_s": 0.008,
        "http_client_cpu_s": 0.002,
        "load_avg": 1.5,
    }


def _results(ratio_16: float) -> dict:
    tp = {c: summarize_rounds([_round(1.0, 1.0)]) for c in ("1", "64")}
    tp["16"] = summarize_rounds([_round(1.0, 1.0 / ratio_16)])
    return {
        "date": "2026-01-01",
        "machine": "x86_64, 2 cores",
        "max_tokens": 64,
        "prompt_tokens": 24,
        "blocks": 1,
        "rounds_per_block": 1,
        "throughput": {c: tp[c] for c in ("1", "16", "64")},
        "splice": {"short": {"turns": 3, "prompt_tokens": 400, "spliced_us": 2000.0, "plain_us": 1000.0}},
        "refit": {"refit_s": 0.08, "load_s": 0.07, "baseline_s": 0.01, "num_bytes": 4 * 2**20, "n": 5},
    }


def test_section_appended_when_missing_and_other_sections_kept():
    out = replace_section(DOC, f"{HEADING} (new)\n\nbody\n")
    assert out.startswith(DOC.rstrip("\n"))
    assert out.endswith(f"streams text\n\n{HEADING} (new)\n\nbody\n")


def test_section_replaced_in_place_up_to_the_next_heading():
    doc = DOC.replace("## Stream transport", f"{HEADING} (old)\n\nold body\n\n## Stream transport")
    out = replace_section(doc, f"{HEADING} (new)\n\nnew body\n")
    assert "old body" not in out and "(old)" not in out
    assert out.index("## Demo run") < out.index(f"{HEADING} (new)") < out.index("## Stream transport")
    assert out.endswith("new body\n\n## Stream transport\n\nstreams text\n")
    assert replace_section(out, f"{HEADING} (new)\n\nnew body\n") == out


def test_section_replaced_at_the_end_of_the_file():
    doc = replace_section(DOC, f"{HEADING} (old)\n\nold\n")
    out = replace_section(doc, f"{HEADING} (new)\n\nnew\n")
    assert out == DOC.rstrip("\n") + f"\n\n{HEADING} (new)\n\nnew\n"


def test_summary_ratio_is_the_median_of_per_round_ratios():
    s = summarize_rounds([_round(1.0, 2.0), _round(2.0, 2.0), _round(1.0, 1.25)])
    assert (s["ratio"], s["ratio_min"], s["ratio_max"]) == pytest.approx((0.8, 0.5, 1.0))
    assert s["raw_tok_s"] == pytest.approx(256.0) and s["http_tok_s"] == pytest.approx(128.0)
    assert (s["raw_tokens"], s["http_tokens"]) == (768, 768)
    assert s["http_server_cpu_ms_per_request"] == pytest.approx(2.0)


def test_rendered_section_reports_target_and_tables():
    text = render_section(_results(ratio_16=0.96))
    assert text.startswith(HEADING)
    assert "| 16 | 256 | 246 | 0.96 (0.96-0.96) | 256 / 256 | 1.0 / 2.0 + 0.5 |" in text
    assert "at 16 and 64 concurrent requests: met." in text
    assert "| short: 3 turns | 400 | 2000 | 1000 | 1000 | 2.00 |" in text
    assert "Refit over baseline: 8.0x." in text
    assert "load average ranged 1.5-1.5" in text
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
        {
            "round": r,
            "concurrency": c,
            "requests": 8,
            "tokens": 100 * c + r,
            "seconds": 1.0,
            "cpu_s": 0.01,
            "load_avg": 1.0,
        }
        for r, c, _ in plan
    ]
    http = [
        {
            "round": r,
            "concurrency": c,
            "requests": 8,
            "tokens": 100 * c + r,
            "seconds": 2.0,
            "client_cpu_s": 0.0,
            "server_cpu_s": 0.02,
            "load_avg": 3.0,
        }
        for r, c, _ in reversed(plan)
    ]
    rows = pair_rounds(raw, http)
    assert sorted(rows) == sorted({c for _, c, _ in plan})
    for rs in rows.values():
        assert all(row["raw_tokens"] == row["http_tokens"] for row in rs)
        assert summarize_rounds(rs)["ratio"] == pytest.approx(0.5)
        assert {row["load_avg"] for row in rs} == {3.0}

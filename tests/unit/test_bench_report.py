"""BENCHMARKS.md rendering: a figure of the demo, stream and gateway sections stands next to a
baseline from the same bench run, as a ratio, when one of the same kind exists; counts that have
none (steps run, the training run's trajectory rate) are shown alone."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.bench import demo, gateway, streams
from streamrl.bench.gateway_rounds import DirectRound, ProxyRound

pytestmark = pytest.mark.unit

STREAMS = streams.streams_results(
    packed=streams.StreamFigures(
        entry_bytes=8000.0, produce_per_s=20000.0, consume_per_s=24000.0, end_to_end_per_s=12000.0
    ),
    lists=streams.StreamFigures(
        entry_bytes=10000.0, produce_per_s=25000.0, consume_per_s=8000.0, end_to_end_per_s=6000.0
    ),
)
SUMMARY = demo.DemoSummary(
    steps=40,
    first5_reward=0.4,
    last5_reward=0.9,
    trajectories_trained=2560,
    duplicate_ids=0,
    validation_accuracy=[(0, 0.5), (40, 1.0)],
    total_time_s=300.0,
)
# 40 steps of 4 s (the training loop: 160 s): 3 s training, 0.5 s refit, 0.5 s waiting on average
TIMES = demo.StepTimes(wait_data_s=[2.0] * 10 + [0.0] * 30, train_s=[3.0] * 40, refit_s=[0.5] * 40, step_s=[4.0] * 40)


def _demo(summary: demo.DemoSummary = SUMMARY) -> str:
    results = demo.summarize(TIMES, summary, trajectories_per_s=12.0, staleness_mean=0.9, max_num_steps=40, lag=1)
    return demo.render_section(results)


def _flat(text: str) -> str:
    """The text with its wrapped lines joined: prose figures are found whatever the wrapping."""
    return " ".join(text.split())


def _rows(text: str, header: str) -> dict[str, list[str]]:
    """Table rows (first cell -> the other cells) of the table whose header starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_demo_step_split_is_shown_as_shares_of_the_whole_step():
    rows = _rows(_demo(), "per-step wall time")
    assert rows["training"][-1] == "75.0%"
    assert rows["waiting for data"][-1] == "12.5%"
    assert rows["whole step"][-1] == "100.0%"


def test_counts_without_a_like_baseline_stand_alone():
    rows = _rows(_demo(), "run figure")
    assert rows == {
        "steps trained (of grpo.max_num_steps 40)": ["40"],
        "trajectories trained per second (whole run, wall clock)": ["12.0"],
    }


def test_every_compared_demo_figure_has_a_same_run_baseline_of_its_kind():
    rows = _rows(_demo(), "compared figure")
    assert len(rows) == 5
    assert all(base and ratio not in ("", "n/a") for _, base, ratio in rows.values())
    assert rows["mean reward, last 5 steps"] == ["0.900", "first 5 steps: 0.400", "2.25x"]
    assert rows["validation accuracy (greedy) at the end"][-1] == "2.00x"
    assert rows["demo total time incl. data, warm start, engine start (min)"][-1] == "1.88x"
    assert rows["trajectories trained twice"][1:] == ["trajectories trained: 2560", "0%"]
    assert rows["mean staleness of consumed groups (steps)"][-1] == "0.90x"


def test_missing_baselines_read_n_a_instead_of_failing():
    summary = msgspec.structs.replace(SUMMARY, validation_accuracy=[], first5_reward=0.0)
    rows = _rows(_demo(summary), "compared figure")
    assert rows["validation accuracy (greedy) at the end"][-1] == "n/a"
    assert rows["mean reward, last 5 steps"][-1] == "n/a"


def test_stream_table_has_a_ratio_row_against_the_lists_baseline():
    rows = _rows(streams.render_section(STREAMS), "token arrays as")
    assert rows["packed / lists, same run"] == ["0.80x", "0.80x", "3.00x", "2.00x"]


def test_gateway_section_reports_overhead_and_memory_against_their_baselines():
    proxy = ProxyRound(
        errors=0,
        calls=10,
        wall_s=5.0,
        client_s=[0.11],
        upstream_s=[0.105],
        overhead_s=[0.005],
        rss_before_kb=200 * 1024,
        rss_open_kb=210 * 1024,
    )
    direct = DirectRound(errors=0, calls=10, wall_s=4.8, client_s=[0.1])
    text = _flat(gateway.render_section(gateway.summarize([proxy], [direct], date="d", machine="m")))
    assert "p50 over the direct call's p50 latency: 5.0%" in text
    assert "Latency through the proxy over direct, p50: 1.10x" in text
    assert "baseline: RSS 200 MiB before the sessions opened, 210 MiB with all 256 open" in text

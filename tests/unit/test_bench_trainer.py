"""The trainer benchmark's pure parts: the paired-round summary, the memory and checkpoint
summaries, the rendered section with its targets, and where the section goes in BENCHMARKS.md."""

import pytest

from streamrl.bench.gateway import HEADING as GATEWAY_HEADING
from streamrl.bench.generator import replace_section
from streamrl.bench.trainer import HEADING, checkpoints, memory, paired, render_section

pytestmark = pytest.mark.unit

MIB = 2**20


def _state(rank_params: tuple[int, int]) -> dict:
    return {
        "single": {"params": 100 * MIB, "grads": 100 * MIB, "optimizer": 200 * MIB},
        "ranks": [{"params": p * MIB, "grads": p * MIB, "optimizer": 2 * p * MIB} for p in rank_params],
    }


def _saves() -> list[dict]:
    def save(is_async: bool, warm_up: bool, blocking_s: float, on_disk_s: float) -> dict:
        return {
            "async": is_async,
            "warm_up": warm_up,
            "blocking_s": blocking_s,
            "on_disk_s": on_disk_s,
            "num_bytes": 300 * MIB,
        }

    return [
        save(True, True, 9.0, 9.0),
        save(False, True, 9.0, 9.0),
        save(False, False, 2.0, 2.0),
        save(True, False, 0.5, 3.0),
        save(True, False, 0.7, 2.6),
        save(False, False, 2.4, 2.4),
    ]


def _results(backend_s: float = 1.0, rank_params: tuple[int, int] = (50, 50)) -> dict:
    compare = [{"backend_s": backend_s, "bare_s": 1.0}, {"backend_s": backend_s, "bare_s": 1.0}]
    scale = [{"ranked_s": 0.8, "single_s": 1.2}, {"ranked_s": 0.6, "single_s": 1.2}]
    return {
        "date": "2026-01-01",
        "machine": "x86_64, 2 cores",
        "cores": 2,
        "world_size": 2,
        "small_params": 5_245_696,
        "large_params": 58_729_984,
        "tokens": 1200,
        "rounds": 2,
        "throughput": paired(compare, "backend", "bare", 1200),
        "first_loss": {"backend": -0.25, "bare": -0.25},
        "scaling": paired(scale, "ranked", "single", 1200),
        "memory": memory(_state(rank_params)),
        "checkpoint": checkpoints(_saves()),
        "load_avg": {"throughput": [1.5, 2.5], "scaling": [3.0, 3.5]},
        "section_s": 150.0,
    }


def test_paired_rounds_give_median_throughput_and_median_of_ratios():
    rounds = [{"a_s": 1.0, "b_s": 2.0}, {"a_s": 2.0, "b_s": 2.0}, {"a_s": 4.0, "b_s": 2.0}]
    p = paired(rounds, "a", "b", tokens=100)
    assert p["tok_s"] == pytest.approx(50.0) and p["base_tok_s"] == pytest.approx(50.0)
    assert (p["ratio"], p["ratio_min"], p["ratio_max"]) == pytest.approx((1.0, 0.5, 2.0))


def test_memory_per_rank_is_the_largest_rank_and_checkpoints_skip_warm_ups():
    m = memory(_state((40, 60)))
    assert m["single"]["total"] == 400 * MIB
    assert m["per_rank"]["params"] == 60 * MIB and m["per_rank"]["total"] == 240 * MIB
    ck = checkpoints(_saves())
    assert ck["sync"] == {
        "blocking_s": pytest.approx(2.2),
        "on_disk_s": pytest.approx(2.2),
        "num_bytes": 300 * MIB,
        "n": 2,
    }
    assert ck["async"]["blocking_s"] == pytest.approx(0.6) and ck["async"]["on_disk_s"] == pytest.approx(2.8)


def test_rendered_section_reports_tables_and_targets():
    text = render_section(_results())
    assert text.startswith(HEADING)
    assert "| 1200 | 1200 | 1.00 (1.00-1.00) | >= 0.9: met |" in text
    assert "| 1714 | 1000 | 1.75 (1.50-2.00) | none (at most 2.0 on 2 cores) |" in text
    assert "| total | 400.0 | 200.0 | 0.50 |" in text
    assert "Target per rank / 1 rank <= 0.55: met." in text
    assert "| synchronous (`checkpointing.async_save: false`) | 2.20 | 2.20 |" in text
    assert "| asynchronous / synchronous | 0.27 | 1.27 |" in text
    assert "5.2M-parameter" in text and "58.7M-parameter" in text
    assert "ranged 1.5-2.5 over the first comparison's steps and 3.0-3.5 over the second's" in text
    slow = render_section(_results(backend_s=1.25, rank_params=(60, 60)))
    assert "| 0.80 (0.80-0.80) | >= 0.9: NOT met |" in slow
    assert "Target per rank / 1 rank <= 0.55: NOT met." in slow


def test_section_goes_after_the_gateway_section_and_is_replaced_in_place():
    doc = f"# Benchmarks\n\n{GATEWAY_HEADING} (x)\n\ngateway\n\n## Pipeline efficiency\n\npipeline\n"
    once = replace_section(doc, render_section(_results()), HEADING, after=GATEWAY_HEADING)
    assert once.index(GATEWAY_HEADING) < once.index(HEADING) < once.index("## Pipeline efficiency")
    again = replace_section(once, render_section(_results(backend_s=1.25)), HEADING, after=GATEWAY_HEADING)
    assert again.count(HEADING) == 1 and "NOT met" in again and again.endswith("pipeline\n")


def test_megatron_rows_compare_each_layout_with_one_rank_of_the_same_model():
    layouts = {
        "dense, 1 rank": {"tok_s": 1000.0, "state": 400 * MIB, "load_avg": 1.0},
        "dense, tensor parallel 2": {"tok_s": 800.0, "state": 210 * MIB, "load_avg": 1.0},
        "dense, data parallel 2": {"tok_s": 1500.0, "state": 400 * MIB, "load_avg": 1.0},
        "MoE, 1 rank": {"tok_s": 500.0, "state": 800 * MIB, "load_avg": 1.0},
        "MoE, expert parallel 2": {"tok_s": 600.0, "state": 500 * MIB, "load_avg": 1.0},
    }
    compare = [{"backend_s": 1.1, "bare_s": 1.0}, {"backend_s": 1.1, "bare_s": 1.0}]
    megatron = {
        "tokens": 1200,
        "throughput": paired(compare, "backend", "bare", 1200),
        "first_loss": {"backend": -0.25, "bare": -0.25},
        "layouts": layouts,
    }
    text = render_section({**_results(), "megatron": megatron})
    assert "| dense, tensor parallel 2 against 1 rank | 800 | 1000 | 0.80 | 0.53 |" in text
    assert "| dense, data parallel 2 against 1 rank | 1500 | 1000 | 1.50 | 1.00 |" in text
    assert "| MoE, expert parallel 2 against 1 rank | 600 | 500 | 1.20 | 0.62 |" in text
    assert "| against the bare torch loop, 1 rank | 1091 | 1200 | 0.91 (0.91-0.91) | |" in text
    assert "megatron" not in render_section(_results())  # without megatron-core: no rows

"""The trainer benchmark's pure parts: the paired-round summary, the memory and checkpoint
summaries, the rendered section with its targets. (Where the section goes in BENCHMARKS.md:
tests/unit/test_bench_suite.py.)"""

import pytest

from streamrl.bench.trainer import render_section
from streamrl.bench.trainer_results import (
    LayoutRun,
    Losses,
    PairedRound,
    Range,
    Save,
    StateBytes,
    TrainerResults,
    WorkerOut,
    checkpoints,
    megatron_figures,
    memory,
    paired,
)

pytestmark = pytest.mark.unit

MIB = 2**20


def _state(rank_params: tuple[int, int]) -> tuple[StateBytes, list[StateBytes]]:
    single = StateBytes(params=100 * MIB, grads=100 * MIB, optimizer=200 * MIB)
    return single, [StateBytes(params=p * MIB, grads=p * MIB, optimizer=2 * p * MIB) for p in rank_params]


def _saves() -> list[Save]:
    def save(is_async: bool, warm_up: bool, blocking_s: float, on_disk_s: float) -> Save:
        return Save(is_async, warm_up, blocking_s, on_disk_s, num_bytes=300 * MIB)

    return [
        save(True, True, 9.0, 9.0),
        save(False, True, 9.0, 9.0),
        save(False, False, 2.0, 2.0),
        save(True, False, 0.5, 3.0),
        save(True, False, 0.7, 2.6),
        save(False, False, 2.4, 2.4),
    ]


def _results(backend_s: float = 1.0, rank_params: tuple[int, int] = (50, 50)) -> TrainerResults:
    compare = [PairedRound(backend_s, 1.0, 1.5), PairedRound(backend_s, 1.0, 2.5)]
    scale = [PairedRound(0.8, 1.2, 3.0), PairedRound(0.6, 1.2, 3.5)]
    return TrainerResults(
        date="2026-01-01",
        machine="x86_64, 2 cores",
        cores=2,
        world_size=2,
        small_params_m=5_245_696 / 1e6,
        large_params_m=58_729_984 / 1e6,
        tokens=1200,
        rounds=2,
        first_loss=Losses(backend=-0.25, bare=-0.25),
        throughput=paired(compare, 1200),
        scaling=paired(scale, 1200),
        load_avg_throughput=Range(1.5, 2.5),
        load_avg_scaling=Range(3.0, 3.5),
        memory=memory(*_state(rank_params)),
        checkpoint=checkpoints(_saves()),
        loading=None,
        megatron=None,
        section_s=150.0,
    )


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_paired_rounds_give_median_throughput_and_median_of_ratios():
    rounds = [PairedRound(1.0, 2.0, 0.0), PairedRound(2.0, 2.0, 0.0), PairedRound(4.0, 2.0, 0.0)]
    p = paired(rounds, tokens=100)
    assert p.tok_s == pytest.approx(50.0) and p.base_tok_s == pytest.approx(50.0)
    assert (p.ratio, p.ratio_min, p.ratio_max) == pytest.approx((1.0, 0.5, 2.0))


def test_memory_per_rank_is_the_largest_rank_and_checkpoints_skip_warm_ups():
    m = {row.kind: row for row in memory(*_state((40, 60)))}
    assert m["total"].single_mib == 400
    assert m["params"].per_rank_mib == 60 and m["total"].per_rank_mib == 240
    ck = checkpoints(_saves())
    assert (ck.sync.blocking_s, ck.sync.on_disk_s) == (pytest.approx(2.2), pytest.approx(2.2))
    assert (ck.shards_mib, ck.n) == (300, 2)
    assert ck.asynchronous.blocking_s == pytest.approx(0.6) and ck.asynchronous.on_disk_s == pytest.approx(2.8)


def test_rendered_section_reports_tables_and_targets():
    text = render_section(_results())
    assert text.startswith("## Trainer\n")
    assert "| 1200 | 1200 | 1.00 (1.00-1.00) | >= 0.9: met |" in text
    assert "| 1714 | 1000 | 1.75 (1.50-2.00) | none (at most 2.0 on 2 cores) |" in text
    assert "| total | 400.0 | 200.0 | 0.50 |" in text
    assert "Target per rank / 1 rank <= 0.55: met." in text
    assert "| synchronous (`checkpointing.async_save: false`) | 2.20 | 2.20 |" in text
    assert "| asynchronous / synchronous | 0.27 | 1.27 |" in text
    assert "5.2M-parameter" in text and "58.7M-parameter" in text
    assert "ranged 1.5-2.5 over the first comparison's steps and 3.0-3.5 over the second's" in _flat(text)
    slow = render_section(_results(backend_s=1.25, rank_params=(60, 60)))
    assert "| 0.80 (0.80-0.80) | >= 0.9: NOT met |" in slow
    assert "Target per rank / 1 rank <= 0.55: NOT met." in slow


def test_megatron_rows_compare_each_layout_with_one_rank_of_the_same_model():
    layouts = {
        "dense, 1 rank": LayoutRun(tok_s=1000.0, state_bytes=400 * MIB, load_avg=1.0),
        "dense, tensor parallel 2": LayoutRun(tok_s=800.0, state_bytes=210 * MIB, load_avg=1.0),
        "dense, data parallel 2": LayoutRun(tok_s=1500.0, state_bytes=400 * MIB, load_avg=1.0),
        "MoE, 1 rank": LayoutRun(tok_s=500.0, state_bytes=800 * MIB, load_avg=1.0),
        "MoE, expert parallel 2": LayoutRun(tok_s=600.0, state_bytes=500 * MIB, load_avg=1.0),
    }
    compare = WorkerOut(
        world_size=1, tokens=1200, rounds=[PairedRound(1.1, 1.0, 1.0)] * 2, backend_loss=-0.25, bare_loss=-0.25
    )
    results = _results()
    results.megatron = megatron_figures(compare, layouts)
    text = render_section(results)
    assert "| dense, tensor parallel 2 against 1 rank | 800 | 1000 | 0.80 | 0.53 |" in text
    assert "| dense, data parallel 2 against 1 rank | 1500 | 1000 | 1.50 | 1.00 |" in text
    assert "| MoE, expert parallel 2 against 1 rank | 600 | 500 | 1.20 | 0.62 |" in text
    assert "| against the bare torch loop, 1 rank | 1091 | 1200 | 0.91 (0.91-0.91) | |" in text
    assert "megatron" not in render_section(_results())  # without megatron-core: no rows

"""The refit benchmark's pure parts: the parameter count of its model sizes, the per-size figures
and target ratios, the extrapolation to the reference run, and the rendered section with its
targets. (Where the section goes in BENCHMARKS.md: tests/unit/test_bench_suite.py.)"""

import pytest

from streamrl.bench.refit import SIZES, num_params, render_section
from streamrl.bench.refit_results import Range, Reference, Spread, extrapolate, figures, summarize
from streamrl.bench.refit_runs import BringUp, Broadcast, HashRates, Prepared, RefitRun, Refits, SaveLoadRound, SizeRun
from streamrl.bench.report import GIB
from streamrl.model_builder import TinyModelSpec

pytestmark = pytest.mark.unit

BYTES = 2 * GIB


def _refit(transport: str, version: int, total_s: float, warm_up: bool = False) -> RefitRun:
    return RefitRun(
        transport=transport,
        version=version,
        warm_up=warm_up,
        total_s=total_s,
        save_s=total_s * 0.75,
        confirm_s=total_s * 0.25,
        num_bytes=BYTES,
        attempts=1,
        load_s=total_s * 0.5,
        load_avg=1.5,
    )


def _size(fs_s: tuple[float, ...] = (8.0, 10.0, 9.0), coll_s: tuple[float, ...] = (4.0, 5.0, 6.0)) -> SizeRun:
    refits = [_refit("filesystem", 1, 30.0, warm_up=True), _refit("collective", 2, 40.0, warm_up=True)]
    refits += [_refit("filesystem", 3 + i, s) for i, s in enumerate(fs_s)]
    refits += [_refit("collective", 3 + len(fs_s) + i, s) for i, s in enumerate(coll_s)]
    rounds = [SaveLoadRound(2.0, 1.0, 3.0, load) for load in (3.0, 1.0, 2.0)]
    return SizeRun(
        name="1091M",
        params=BYTES // 2,
        prepare=Prepared(
            build_s=1.0,
            num_bytes=BYTES,
            rounds=rounds,
            save_s=2.0,
            load_s=1.0,
            total_s=3.0,
            hash_gib_s=HashRates(sha256=1.0, xxh3_128=8.0),
            cast_s=3.0,
        ),
        broadcast=Broadcast(num_bytes=BYTES, buckets=9, rounds_s=[1.0, 1.0], s=1.0, load_avg=1.2),
        refit=Refits(BringUp(auto=40.0, dummy=20.0), refits),
        peak_memory_bytes=12 * GIB,
    )


def _text(**size: tuple[float, ...]) -> str:
    results = summarize(
        [_size(**size)],
        date="2026-01-01",
        machine="x86_64, 2 cores",
        cores=2,
        memory_bytes=24 * GIB,
        refits=3,
        bucket_mb=256,
        section_s=400.0,
    )
    return render_section(results)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_num_params_counts_the_models_that_transformers_builds():
    from transformers import Qwen3ForCausalLM

    from streamrl.model_builder import qwen3_config

    spec = TinyModelSpec(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16)
    model = Qwen3ForCausalLM(qwen3_config(spec, spec.vocab_size, pad_id=0, bos_id=0, eos_id=1))
    assert num_params(spec) == sum(p.numel() for p in model.parameters())
    published_gib = [2 * num_params(s) / GIB for s in SIZES]  # bfloat16
    assert published_gib == sorted(published_gib)
    assert 0.08 < published_gib[0] < 0.15 and 0.4 < published_gib[1] < 0.6 and 1.8 < published_gib[-1] < 2.2


def test_figures_take_medians_of_the_timed_refits_and_the_target_ratios():
    f = figures(_size())
    assert f.filesystem.total == Spread(median=9.0, min=8.0, max=10.0)
    assert f.collective.total.median == 5.0 and f.collective.n == 3  # warm-ups left out
    assert f.collective.save_s == pytest.approx(3.75)
    assert f.collective_ratio == pytest.approx(1.0 / 5.0)  # same bytes: raw 1 s against 5 s
    assert f.filesystem_ratio == pytest.approx(9.0 / 3.0)
    assert (f.load_avg_refits, f.load_avg_baselines) == (Range(1.5, 1.5), Range(1.0, 2.0))  # baselines' warm-up out


def test_extrapolation_scales_the_measured_per_byte_costs():
    f = figures(_size())
    ref = Reference(params=64e9, trainer_ranks=8, generators=4, network_gib_s=10.0, parallel_fs_gib_s=1000.0)
    model = extrapolate(f, ref)
    gib = 128e9 / GIB
    # filesystem: each rank writes 1/8 at 2 GiB / 6.75 s, then a generator reads it all at 2 GiB / 4.5 s
    assert model.filesystem_s == pytest.approx(gib / 8 / (2 / 6.75) + gib / (2 / 4.5))
    # collective: the wire time at 10 GiB/s times the measured 5x over the raw broadcast; without
    # the 3 s cast, 2x
    assert model.collective_s == pytest.approx(gib / 10 * 5)
    assert model.collective_gpu_s == pytest.approx(gib / 10 * 2)
    assert model.sha_refit_s == pytest.approx(2 * gib / 1.0)
    assert ref.delta_sync_s == (pytest.approx(0.01 * gib / 10), pytest.approx(0.03 * gib / 10))
    rows = {line.split(" | ")[0]: line for line in _text().splitlines() if line.startswith("| ")}
    assert rows["| NeMo-RL `nccl_reshard`"].endswith("(published) |")
    assert rows["| filesystem (ours)"].endswith("(model) |")


def test_a_shared_filesystem_bounds_the_filesystem_model():
    f = figures(_size())
    slow = Reference(params=64e9, trainer_ranks=8, generators=4, parallel_fs_gib_s=1.0)
    gib = 128e9 / GIB
    assert extrapolate(f, slow).filesystem_s == pytest.approx(gib / 1.0 + 4 * gib / 1.0)  # written once, read by 4


def test_the_section_says_whether_each_target_is_met():
    missed = _text()
    assert missed.startswith("## Refit\n")
    assert "collective bandwidth / raw broadcast >= 0.8: NOT met (0.20)" in _flat(missed)
    assert "filesystem / raw write+read <= 1.5: NOT met (3.00)" in _flat(missed)
    assert "**A model, not a measurement:**" in missed and "(published)" in missed and "(model)" in missed
    assert "reading the checkpoint (`load_format: auto`) vs on random weights" in _flat(missed)
    assert "40.0 vs 20.0" in _flat(missed)
    met = _flat(_text(fs_s=(4.0, 4.0), coll_s=(1.1, 1.2)))
    assert ">= 0.8: met (0.87)" in met and "<= 1.5: met (1.33)" in met

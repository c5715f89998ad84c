"""The demo-variants section of BENCHMARKS.md: each run's figures read back from its records (the
nucleus-sampling mismatch with and without the truncation, the dynamic-sampling filter and the
reward of every judged group), and the tables the section renders from them. (Where the section
goes in BENCHMARKS.md: tests/unit/test_bench_suite.py.)"""

from __future__ import annotations

import msgspec
import pytest

from shared.records import DynamicSamplingStats, ValidationRecord, encode_record
from streamrl.bench import demo_variants as bdv
from tests.support.records import learner_metrics, step_record

pytestmark = pytest.mark.unit


def _write(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_bytes(b"".join(encode_record(r) + b"\n" for r in records))


def _validation(step: int, accuracy: float) -> ValidationRecord:
    fields = dict(validation_id=f"v{step}", step=step, time=0.0, accuracy=accuracy, num_samples=64)
    return ValidationRecord(**fields, num_failed=0, num_missing=0, avg_length=9.0, duration_s=1.0)


def _run(tmp_path, name, steps, *, untruncated=False, filtered=None, spike=None):
    records = []
    for s in range(steps):
        r = step_record(s, reward_mean=0.4 + 0.02 * s)
        errors = dict(token_mult_prob_error=1.0 + 0.001 * s, gen_kl_error=1e-6 * (s + 1), max_abs_logprob_diff=0.1)
        if s == spike:  # one token far apart outweighs the step's other tokens
            errors |= dict(token_mult_prob_error=3.0, max_abs_logprob_diff=6.5)
        if untruncated:
            errors |= dict(token_mult_prob_error_untruncated=1.05, gen_kl_error_untruncated=2e-3)
        r = msgspec.structs.replace(r, learner=learner_metrics(**errors))
        if filtered is not None:
            ds = DynamicSamplingStats(
                num_filtered_groups=filtered[s],
                filtered_fraction=filtered[s] / (filtered[s] + 8),
                num_gen_batches=1,
                filtered_reward_mean=1.0,
                filtered_total=sum(filtered[: s + 1]),
            )
            r = msgspec.structs.replace(r, dynamic_sampling=ds)
        records.append(r)
    _write(tmp_path / name, [_validation(0, 0.5), *records, _validation(steps, 0.9)])
    return bdv.RunRecord(name, list(bdv.VARIANTS[name]), 0, 120.0, bdv.run_figures(tmp_path / name, 8))


def _render(runs: dict[str, bdv.RunRecord]) -> str:
    d = bdv.summarize(list(runs.values()), date="2026-12-01", machine="m", max_num_steps=7, seed=42, groups=8)
    return bdv.render_section(d)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_run_figures_and_the_rendered_section(tmp_path):
    filtered = [0, 0, 2, 8, 8, 4, 2]
    runs = {
        "default": _run(tmp_path, "default", 7, spike=4),
        "top_p": _run(tmp_path, "top_p", 7, untruncated=True),
        "dynamic_sampling": _run(tmp_path, "dynamic_sampling", 7, filtered=filtered),
    }
    ds = runs["dynamic_sampling"].steps
    assert runs["default"].steps.token_mult_prob_error_untruncated == [None] * 7
    assert ds.filtered_groups == 24 and ds.filtered_fraction[3] == 0.5
    # every judged group: 8 trained at the batch's mean reward and the filtered ones (all solved) at 1
    assert ds.reward_judged[3] == pytest.approx((0.46 * 8 + 8) / 16)
    assert runs["default"].steps.reward_judged == pytest.approx(runs["default"].steps.reward)
    text = _render(runs)
    assert text.startswith("## Demo variants\n\n`streamrl bench --only demo_variants`")
    assert (
        "| temperature only, untruncated (before the fix; `*_untruncated`, same forward pass) | top_p 0.9 | "
        "1.05000 | 1.05000 | 1.05000 | 2.00e-03 | 2.00e-03 | 2.00e-03 |" in text
    )
    assert (
        "| under the top-p nucleus, renormalised, as sampled (after the fix; trained on) | top_p 0.9 | 1.00000 | "
        "1.00300 | 1.00300 | 1.00e-06 | 4.00e-06 | 4.00e-06 |" in text
    )
    # the spike moves the baseline run's mean, not its median
    assert "| temperature only (nothing to truncate): baseline | top_p 1.0 | 1.00000 | 1.28814 | 1.00300 |" in text
    assert "Steps above 1.1: 1 of the top_p 1.0 run (at most 3.00, a token 6.5 nats apart). One such" in _flat(text)
    without_spike = _render({**runs, "default": _run(tmp_path, "default", 7)})
    assert "No step of either run has a token_mult_prob_error above 1.1. The untruncated" in _flat(without_spike)
    assert "excess over 1 is 0.00e+00 after the fix against 5.00e-02 before it" in _flat(text)
    assert "| the same, first step / last step | - | 0.000 / 0.200 |" in text
    assert "| validation accuracy (greedy), start -> end | 0.500 -> 0.900 (step 7) | 0.500 -> 0.900 (step 7) |" in text
    assert "| 5-6 | 0.510 | 0.510 |" in text  # the last window is short
    assert "| groups filtered, whole run (trained: 8 per step) | 0 | 24 |" in text

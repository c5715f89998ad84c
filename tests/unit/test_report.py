"""Run outputs besides metrics.jsonl: the TensorBoard event file the metrics writer keeps, record
sinks, and ``streamrl report`` turning a metrics.jsonl written by the real writer into PNGs."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer.metrics_log import MetricsLog
from shared.records import read_records
from tests.support.records import step_record, validation_record

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the TensorBoard event files in ``folder`` (TFRecord framing of Event protos)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_records_go_to_jsonl_tensorboard_and_sinks(tmp_path):
    seen = []
    log = MetricsLog(tmp_path / "metrics.jsonl", sinks=[seen.append], tensorboard_dir=tmp_path / "tb")
    log.open()
    written = [step_record(step) for step in range(3)] + [validation_record(3, 0.75, pass_k=0.9, env={"turns": 2.0})]
    for record in written:
        log.write(record)
    log.close()
    assert read_records(tmp_path / "metrics.jsonl") == written and seen == written  # typed, lossless
    scalars = _read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/reward_mean"]] == [0, 1, 2]  # batch figures under their own names
    assert scalars["train/reward_mean"][2][1] == pytest.approx(0.4)
    assert scalars["train/loss"][1][1] == pytest.approx(0.01)  # and the learner's
    assert scalars["train/refit/checksum_s"][0][1] == pytest.approx(0.1)  # other parts keep a prefix
    assert scalars["train/staleness/counts/1"] == [(1, 8.0), (2, 8.0)]
    assert scalars["validation/accuracy"] == [(3, 0.75)] and scalars["validation/env/turns"] == [(3, 2.0)]
    assert "train/consumed_ids" not in scalars and "train/step" not in scalars and "train/time" not in scalars


def test_a_failing_sink_does_not_stop_the_writer(tmp_path):
    def broken(record):
        raise RuntimeError("sink down")

    log = MetricsLog(tmp_path / "metrics.jsonl", sinks=[broken])
    log.open()
    log.write(step_record(0))
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def _write_run(folder: Path, *, validation: bool) -> None:
    log = MetricsLog(folder / "metrics.jsonl", sinks=[])
    log.open()
    for step in range(8):
        log.write(step_record(step))
        if validation and step % 4 == 3:
            log.write(validation_record(step + 1, 0.5 + 0.05 * step))
    log.close()


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "report", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_report_writes_every_plot_and_prints_the_paths(tmp_path):
    _write_run(tmp_path, validation=True)
    out = _report(str(tmp_path))
    assert out.returncode == 0, out.stderr
    paths = [Path(p) for p in out.stdout.split()]
    assert [p.name for p in paths] == ["reward.png", "validation.png", "staleness.png", "timing.png"]
    for p in paths:
        assert p.parent == tmp_path / "report" and p.read_bytes()[:8] == PNG_MAGIC
        width, height = struct.unpack(">II", p.read_bytes()[16:24])
        assert (width, height) == (880, 462)


def test_report_skips_plots_without_data_and_honours_out(tmp_path):
    from streamrl.report import build_report

    _write_run(tmp_path / "run", validation=False)
    written, skipped = build_report(tmp_path / "run", tmp_path / "plots")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["reward.png", "staleness.png", "timing.png"]
    assert sorted(written) == ["reward", "staleness", "timing"] and skipped == ["validation"]


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1: not a streamrl metrics record"):
        read_records(tmp_path / "metrics.jsonl")


def test_report_without_metrics_names_the_file(tmp_path):
    from streamrl.report import ReportError, build_report

    with pytest.raises(ReportError, match=f"no metrics.jsonl in {tmp_path}"):
        build_report(tmp_path)

"""Run outputs besides metrics.jsonl: the TensorBoard event file the metrics writer keeps, record
sinks, and ``streamrl report`` turning a metrics.jsonl written by the real writer into PNGs and a
table of where each step's time went."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services.trainer.metrics_log import MetricsLog
from shared.records import AutoscaleRecord, read_records
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
    paths = [Path(p) for p in out.stdout.split() if p.endswith(".png")]
    assert [p.name for p in paths] == ["reward.png", "validation.png", "staleness.png", "timing.png", "pipeline.png"]
    for p in paths:
        assert p.parent == tmp_path / "report" and p.read_bytes()[:8] == PNG_MAGIC
        width, height = struct.unpack(">II", p.read_bytes()[16:24])
        assert (width, height) == ((990, 924) if p.name == "pipeline.png" else (880, 462))


def test_report_skips_plots_without_data_and_honours_out(tmp_path):
    from streamrl.report import build_report

    _write_run(tmp_path / "run", validation=False)
    written, skipped = build_report(tmp_path / "run", tmp_path / "plots")
    names = ["pipeline.png", "reward.png", "staleness.png", "timing.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == names
    assert sorted(written) == ["pipeline", "reward", "staleness", "timing"] and skipped == ["validation"]


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1: not a streamrl metrics record"):
        read_records(tmp_path / "metrics.jsonl")


def test_report_without_metrics_names_the_file(tmp_path):
    from streamrl.report import ReportError, build_report

    with pytest.raises(ReportError, match=f"no metrics.jsonl in {tmp_path}"):
        build_report(tmp_path)


def _write_pipeline_run(folder: Path) -> None:
    """Six steps with the pipeline's figures, two generators then three (an autoscaler decision
    after step 2), and a seventh step from before those figures existed."""
    log = MetricsLog(folder / "metrics.jsonl", sinks=[])
    log.open()
    for step in range(6):
        record = msgspec.structs.replace(
            step_record(step),
            wait_fraction=0.25 + 0.01 * step,
            mfu=0.0123 + 0.001 * step,
            model_tflops=12.3 + step,
            rollout_s=4.5 + step,
            generation_s=3.25,
            workers={"generator": 2 if step < 3 else 3, "gym_gateway": 1},
        )
        log.write(record)
        if step == 2:
            log.write(
                AutoscaleRecord(
                    step=3,
                    time=1003.5,
                    role="generator",
                    before=2,
                    after=3,
                    reason="starved 2+ steps",
                    signals={"wait_fraction": 0.27},
                    outcome="done",
                    backend="local",
                )
            )
    log.write(step_record(6))
    log.close()


def test_report_draws_the_pipeline_and_prints_each_steps_numbers(tmp_path):
    _write_pipeline_run(tmp_path)
    out = _report(str(tmp_path), "--rows", "5")
    assert out.returncode == 0, out.stderr
    figure = tmp_path / "report" / "pipeline.png"
    assert str(figure) in out.stdout.splitlines() and figure.read_bytes()[:8] == PNG_MAGIC
    table = out.stdout.split("pipeline per step")[1].splitlines()[1:]
    header = "step wall s wait batch train refit checkpoint other wait% mfu% TFLOP/s rollout s model s gens gws"
    assert table[0].split() == header.split()
    rows = {line.split()[0]: line.split() for line in table[1:6]}
    assert sorted(rows) == ["2", "3", "4", "5", "6"]  # the last five steps
    # step 3: wall 3.73 s = wait 1.00 + batch 0.00 + train 2.00 + refit 0.73 + checkpoint 0.00 + other 0.00
    assert rows["3"][1:8] == ["3.73", "1.00", "0.00", "2.00", "0.73", "0.00", "0.00"]
    assert rows["3"][8:] == ["28.0", "1.53", "15.3", "7.50", "3.25", "3", "1"]
    assert rows["6"][8:] == ["-"] * 7  # a record from before the figures: dashes
    assert "(the last 5 of 7 steps; --rows 0 shows every one)" in table
    shares = next(line for line in table if line.startswith("all 7 steps"))
    assert "wait for data" in shares and "mean MFU 1.48%" in shares
    assert "autoscaler after step 2: generator 2 -> 3 (done): starved 2+ steps" in table


def test_pipeline_table_of_the_phases_adds_up_to_the_step(tmp_path):
    from streamrl.report_pipeline import PHASES

    record = step_record(4)
    assert sum(phase(record) for _, phase in PHASES) == pytest.approx(record.timing.step_s)


def test_the_live_display_shows_the_wait_and_mfu():
    from streamrl.progress import utilisation

    record = msgspec.structs.replace(step_record(1), wait_fraction=0.614, mfu=0.0312, model_tflops=30.86)
    assert utilisation(record) == "waited 61%  mfu 3.1% (30.9 TFLOP/s per device)"
    assert utilisation(step_record(1)) == "waited -  mfu -"  # a record without them

"""``streamrl report RUN_DIR``: plots of a run's metrics.jsonl as PNG files.

    reward.png      training reward per step (mean, 5-step moving mean, +-1 std band)
    validation.png  validation accuracy (and pass@k) per step
    staleness.png   trajectories consumed per step by age (step - launch version), stacked,
                    with the mean and max group staleness
    timing.png      step time per phase, stacked: waiting for data, training, and the refit's
                    write, checksum and confirm phases
    pipeline.png    the pipeline: each step's time by phase beside the rollouts' duration, the
                    wait fraction and MFU, the workers and the autoscaler's decisions
                    (`streamrl.report_pipeline`, which also gives it as text: `pipeline_text`)

A plot whose data the run does not have (no validation ran) is skipped and reported as such.
Reads only metrics.jsonl (`shared.records.read_records`); called by `streamrl.cli`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from shared.records import (
    Record,
    StepRecord,
    ValidationRecord,
    autoscale_records,
    read_records,
    step_records,
    validation_records,
)
from streamrl.report_pipeline import pipeline_table, plot_pipeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The stacked phases of a step's wall time, as read from its record.
TIMING_PHASES: tuple[tuple[str, Callable[[StepRecord], float]], ...] = (
    ("wait for data", lambda r: r.timing.wait_data_s),
    ("train", lambda r: r.timing.train_s),
    ("refit: write", lambda r: r.refit.write_s),
    ("refit: checksum", lambda r: r.refit.checksum_s),
    ("refit: confirm", lambda r: r.refit.confirm_s),
)


class ReportError(ValueError):
    """The folder holds no metrics to plot."""


def find_metrics(run_dir: Path) -> Path:
    """metrics.jsonl in ``run_dir`` (or ``run_dir`` itself when it is the file)."""
    path = run_dir if run_dir.is_file() else run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"no metrics.jsonl in {run_dir} (logger.log_dir of the run, by default run.output_dir)")
    return path


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")  # after use(): pyplot picks its backend on import


def _figure(title: str, ylabel: str) -> tuple[ModuleType, Figure, Axes]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt: ModuleType, fig: Figure, ax: Axes, out: Path) -> Path:
    if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_reward(train: list[StepRecord], out: Path) -> Path | None:
    if not train:
        return None
    plt, fig, ax = _figure("training reward", "reward")
    xs, ys = [r.step for r in train], [r.batch.reward_mean for r in train]
    sd = [r.batch.reward_std for r in train]
    ax.plot(xs, ys, marker="o", ms=3, alpha=0.5, label="reward mean")
    ax.fill_between(
        xs,
        [y - s for y, s in zip(ys, sd, strict=True)],
        [y + s for y, s in zip(ys, sd, strict=True)],
        alpha=0.12,
        label="+-1 std",
    )
    window = 5
    if len(ys) >= window:
        smooth = [sum(ys[i - window + 1 : i + 1]) / window for i in range(window - 1, len(ys))]
        ax.plot(xs[window - 1 :], smooth, lw=2.2, label=f"{window}-step mean")
    return _save(plt, fig, ax, out)


def plot_validation(vals: list[ValidationRecord], out: Path) -> Path | None:
    if not vals:
        return None
    plt, fig, ax = _figure("validation", "score")
    ax.plot([r.step for r in vals], [r.accuracy for r in vals], marker="s", label="accuracy")
    with_k = [(r.step, r.pass_k) for r in vals if r.pass_k is not None]
    if with_k:
        ax.plot([s for s, _ in with_k], [p for _, p in with_k], marker="^", label="pass@k")
    ax.set_ylim(-0.02, 1.02)
    return _save(plt, fig, ax, out)


def plot_staleness(train: list[StepRecord], out: Path) -> Path | None:
    if not train:
        return None
    plt, fig, ax = _figure("staleness of consumed trajectories", "trajectories")
    xs = [r.step for r in train]
    ages = sorted({int(a) for r in train for a in r.staleness.counts})
    bottom = [0.0] * len(train)
    for age in ages:
        counts = [float(r.staleness.counts.get(str(age), 0)) for r in train]
        ax.bar(xs, counts, bottom=bottom, width=0.8, label=f"age {age}")
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    right = ax.twinx()
    right.plot(xs, [r.staleness.mean for r in train], color="black", lw=1.6, label="group mean")
    right.plot(xs, [r.staleness.max for r in train], color="black", ls="--", lw=1.0, label="group max")
    right.set_ylabel("steps")
    right.set_ylim(0, max(r.staleness.max for r in train) + 1)
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = right.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="lower right", fontsize=8)
    return _save(plt, fig, ax, out)


def plot_timing(train: list[StepRecord], out: Path) -> Path | None:
    if not train:
        return None
    plt, fig, ax = _figure("time per step", "seconds")
    xs = [r.step for r in train]
    bottom = [0.0] * len(train)
    for label, phase in TIMING_PHASES:
        values = [phase(r) for r in train]
        ax.bar(xs, values, bottom=bottom, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(xs, [r.timing.step_s for r in train], color="black", lw=1.2, label="step total")
    return _save(plt, fig, ax, out)


def _records(run_dir: Path) -> list[Record]:
    records = read_records(find_metrics(run_dir))
    if not records:
        raise ReportError(f"{find_metrics(run_dir)} is empty")
    return records


def pipeline_text(run_dir: Path, max_rows: int = 50) -> str:
    """The pipeline per step as a table (`streamrl.report_pipeline.pipeline_table`)."""
    records = _records(run_dir)
    return pipeline_table(step_records(records), autoscale_records(records), max_rows)


def build_report(run_dir: Path, out_dir: Path | None = None) -> tuple[dict[str, Path], list[str]]:
    """Write every plot the metrics allow; ({name: png path}, [names skipped for lack of data])."""
    records = _records(run_dir)
    train, vals = step_records(records), validation_records(records)
    plots: dict[str, Callable[[Path], Path | None]] = {
        "reward": lambda p: plot_reward(train, p),
        "validation": lambda p: plot_validation(vals, p),
        "staleness": lambda p: plot_staleness(train, p),
        "timing": lambda p: plot_timing(train, p),
        "pipeline": lambda p: plot_pipeline(train, autoscale_records(records), p, _pyplot()),
    }
    out = out_dir or (run_dir if run_dir.is_dir() else run_dir.parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    skipped: list[str] = []
    for name, plot in plots.items():
        path = plot(out / f"{name}.png")
        if path is None:
            skipped.append(name)
        else:
            written[name] = path
    return written, skipped

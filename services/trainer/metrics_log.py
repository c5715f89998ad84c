"""Per-step metrics as JSONL (one object per step or validation), TensorBoard scalars, and the
reward-curve plot.

Each training record holds reward, losses, staleness, timings and the ids of the trajectories the
step consumed (the audit ledger: no id may appear twice in a run). Every record written also goes
to the record sinks (the trainer's Prometheus metrics) and, with ``logger.tensorboard``, to a
TensorBoard event file: every numeric field as a scalar under ``train/`` or ``validation/``, at
the record's step. Written by the trainer runtime; read by ``streamrl report`` and the benchmarks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RecordSink = Callable[[dict[str, Any]], None]


class MetricsLog:
    def __init__(
        self, path: Path, *, sinks: list[RecordSink] | None = None, tensorboard_dir: Path | None = None
    ) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", buffering=1)
        self.sinks = sinks if sinks is not None else []
        self._tb = None
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(tensorboard_dir), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        if self._tb is not None:
            write_scalars(self._tb, record)
        for sink in self.sinks:
            try:
                sink(record)
            except Exception:  # a metrics sink must never stop training
                log.exception("metrics sink %r failed", sink)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def write_scalars(writer, record: dict[str, Any]) -> None:
    """Every numeric field of ``record`` (nested dicts flattened with '/') at the record's step."""
    prefix = "validation" if record.get("kind") == "validation" else "train"
    step = int(record.get("step", 0))
    for key, value in _numeric(record):
        if key not in ("step", "time"):
            writer.add_scalar(f"{prefix}/{key}", value, global_step=step)


def _numeric(record: dict[str, Any], prefix: str = ""):
    for key, value in record.items():
        if isinstance(value, (bool, int, float)):
            yield prefix + key, float(value)
        elif isinstance(value, dict):
            yield from _numeric(value, f"{prefix}{key}/")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(records: list[dict[str, Any]], out: Path, title: str = "") -> Path | None:
    """reward_mean per step (and validation accuracy if any) to a PNG."""
    steps = [r for r in records if r.get("kind") == "train"]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = [r["step"] for r in steps], [r["reward_mean"] for r in steps]
    ax.plot(xs, ys, marker="o", ms=3, alpha=0.45, label="train reward")
    window = 5
    if len(ys) >= window:
        smooth = [sum(ys[i - window + 1 : i + 1]) / window for i in range(window - 1, len(ys))]
        ax.plot(xs[window - 1 :], smooth, lw=2.2, label=f"train reward ({window}-step mean)")
    vals = [r for r in records if r.get("kind") == "validation"]
    if vals:
        ax.plot([r["step"] for r in vals], [r["accuracy"] for r in vals], marker="s", label="validation accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "streamrl async GRPO")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

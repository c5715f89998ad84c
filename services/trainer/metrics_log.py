"""Where the trainer's records go: metrics.jsonl, TensorBoard scalars, record sinks, the reward plot.

Each record (`shared.records.StepRecord` per step, `ValidationRecord` per validation) is one JSON
line of metrics.jsonl; a step's record holds reward, losses, staleness, timings and the ids of the
trajectories it consumed (the audit ledger: no id may appear twice in a run). Every record written
also goes to the record sinks (the trainer's Prometheus metrics) and, with ``logger.tensorboard``,
to a TensorBoard event file: every numeric figure as a scalar under ``train/`` or ``validation/``
at the record's step. A step's ``batch.reward_mean`` is ``train/reward_mean`` and its
``learner.loss`` is ``train/loss``; other parts keep their name as a prefix
(``train/staleness/mean``, ``train/env/turns``). Its ``nemo_rl`` part is written under NeMo-RL's
own names (``timing/train/total_step_time``, ``performance/tokens_per_sec``,
``train/buffer_size``), so dashboards built on NeMo-RL's logs carry over. Written by the control
plane; read back with `shared.records.read_records`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from shared.records import (
    AutoscaleRecord,
    Record,
    StepRecord,
    ValidationRecord,
    encode_record,
    step_records,
    validation_records,
)

log = logging.getLogger(__name__)

RecordSink = Callable[[Record], None]

# Fields that are not scalars of the record's step (the step itself, wall time, id ledgers), or
# whose scalars have names of their own (NeMo-RL's).
_NOT_SCALARS = {"step", "time", "weight_version", "consumed_ids", "evicted_ids", "validation_id", "nemo_rl"}
# Parts of a step record whose figures are written under their own names (``batch.reward_mean`` ->
# ``reward_mean``, ``learner.loss`` -> ``loss``); every other mapping keeps its field name as a
# prefix (``staleness/mean``, ``refit/total_s``, ``env/turns``).
_FLAT = {"batch", "learner"}


class MetricsLog:
    def __init__(self, path: Path, *, sinks: list[RecordSink], tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self.sinks = sinks
        self.tensorboard_dir = tensorboard_dir
        self._fh: IO[bytes] | None = None
        self._tb: Any = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab", buffering=0)
        if self.tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.tensorboard_dir), flush_secs=10)

    def write(self, record: Record) -> None:
        if self._fh is None:
            raise RuntimeError("MetricsLog.write before open()")
        self._fh.write(encode_record(record) + b"\n")
        if self._tb is not None:
            write_scalars(self._tb, record)
        for sink in self.sinks:
            try:
                sink(record)
            except Exception:  # a metrics sink must never stop training
                log.exception("metrics sink %r failed", sink)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def write_scalars(writer: Any, record: Record) -> None:
    """Every numeric figure of ``record`` at the record's step."""
    for tag, value in scalars(record):
        writer.add_scalar(tag, value, global_step=record.step)


def scalars(record: Record) -> Iterator[tuple[str, float]]:
    """(tag, value) of every numeric figure, named as the module docstring says."""
    prefix = {ValidationRecord: "validation/", AutoscaleRecord: "autoscale/"}.get(type(record), "train/")
    yield from _numeric(msgspec.to_builtins(record), prefix, top=True)
    if isinstance(record, StepRecord) and record.nemo_rl is not None:
        yield from record.nemo_rl.named().items()


def _numeric(node: dict[str, Any], prefix: str, *, top: bool = False) -> Iterator[tuple[str, float]]:
    for key, value in node.items():
        if top and key in _NOT_SCALARS:
            continue
        if isinstance(value, bool | int | float):
            yield prefix + key, float(value)
        elif isinstance(value, dict):
            yield from _numeric(value, prefix if top and key in _FLAT else f"{prefix}{key}/")


def plot_reward_curve(records: list[Record], out: Path, title: str = "") -> Path | None:
    """The training reward per step (and the validation accuracy, if any) to a PNG."""
    steps = step_records(records)
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = [r.step for r in steps], [r.batch.reward_mean for r in steps]
    ax.plot(xs, ys, marker="o", ms=3, alpha=0.45, label="train reward")
    window = 5
    if len(ys) >= window:
        smooth = [sum(ys[i - window + 1 : i + 1]) / window for i in range(window - 1, len(ys))]
        ax.plot(xs[window - 1 :], smooth, lw=2.2, label=f"train reward ({window}-step mean)")
    vals = validation_records(records)
    if vals:
        ax.plot([r.step for r in vals], [r.accuracy for r in vals], marker="s", label="validation accuracy")
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

"""Per-step metrics as JSONL (one object per step or validation) and the reward-curve plot.

Each training record holds reward, losses, staleness, timings and the ids of the trajectories the
step consumed (the audit ledger: no id may appear twice in a run). Written by the trainer runtime;
read by ``streamrl report`` and the benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._fh.close()


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

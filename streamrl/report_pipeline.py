"""``streamrl report``'s picture of the pipeline: where each step's time went, how busy the trainer's
devices were, and how many workers ran, as a figure (`plot_pipeline`) and as text
(`pipeline_table`).

    pipeline.png  top:    each step's wall time stacked by the trainer's phases: waiting for data,
                          building the batch, training, the refit, the checkpoint, and the rest
                          (pauses, bookkeeping); the rollouts' mean duration, start to publish, and
                          their time in model calls as lines: they run alongside the trainer, so
                          they are not part of the stack
                  middle: the wait fraction and the MFU per step (%), the achieved TFLOP/s per
                          trainer device on the right axis
                  bottom: live generators and gateway workers at each step's end, and the
                          autoscaler's decisions (▲ up, ▼ down, ✕ failed) between the steps they
                          followed

A step record before these figures existed draws its phases only. Called by `streamrl.report`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from shared.records import AutoscaleRecord, StepRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes

WORKER_KINDS = (("generator", "generators"), ("gym_gateway", "gateway workers"))


def _rest(r: StepRecord) -> float:
    known = r.timing.wait_data_s + r.timing.train_s + r.refit.total_s + r.timing.checkpoint_s
    return max(0.0, r.timing.step_s - known)


# A step's wall time, phase by phase; they add up to timing.step_s.
PHASES: tuple[tuple[str, Callable[[StepRecord], float]], ...] = (
    ("wait for data", lambda r: r.timing.wait_data_s),
    ("batch", lambda r: r.timing.batch_s),
    ("train", lambda r: r.timing.train_s - r.timing.batch_s),
    ("refit", lambda r: r.refit.total_s),
    ("checkpoint", lambda r: r.timing.checkpoint_s),
    ("other", _rest),
)


def plot_pipeline(train: list[StepRecord], decisions: list[AutoscaleRecord], out: Path, plt: ModuleType) -> Path | None:
    """The three panels of the module docstring to ``out`` with ``plt`` (matplotlib.pyplot on a
    non-interactive backend); None without step records."""
    if not train:
        return None
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 8.4), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]})
    _time_panel(top, train)
    _utilisation_panel(mid, train)
    _worker_panel(low, train, decisions)
    low.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _time_panel(ax: Axes, train: list[StepRecord]) -> None:
    xs = [r.step for r in train]
    bottom = [0.0] * len(train)
    for label, phase in PHASES:
        values = [phase(r) for r in train]
        ax.bar(xs, values, bottom=bottom, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    rollouts = [
        (r.step, r.rollout_s, r.generation_s) for r in train if r.rollout_s is not None and r.generation_s is not None
    ]
    if rollouts:
        ax.plot(
            [s for s, _, _ in rollouts], [w for _, w, _ in rollouts], "k--", lw=1.2, label="rollout (mean, alongside)"
        )
        ax.plot([s for s, _, _ in rollouts], [g for _, _, g in rollouts], "k:", lw=1.2, label="  of it in model calls")
    highest = max([*bottom, *(w for _, w, _ in rollouts)])
    ax.set_ylim(0, 1.3 * highest if highest > 0 else 1.0)  # room for the legend above the bars
    ax.set_title("where each step's time went")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7, ncol=4)


def _utilisation_panel(ax: Axes, train: list[StepRecord]) -> None:
    waits = [(r.step, 100 * r.wait_fraction) for r in train if r.wait_fraction is not None]
    mfus = [(r.step, 100 * r.mfu) for r in train if r.mfu is not None]
    tflops = [(r.step, r.model_tflops) for r in train if r.model_tflops is not None]
    for points, style, label in ((waits, "o-", "waiting for data"), (mfus, "s-", "MFU")):
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], style, ms=3, lw=1.2, label=label)
    ax.set_ylabel("% of step / of peak")
    ax.grid(alpha=0.3)
    if tflops:
        right = ax.twinx()
        right.plot([s for s, _ in tflops], [v for _, v in tflops], "^:", ms=3, color="tab:green", label="TFLOP/s")
        right.set_ylabel("TFLOP/s per device")
        right.set_ylim(bottom=0)
        right.legend(loc="upper right", fontsize=7)
    if not (waits or mfus or tflops):
        ax.text(0.5, 0.5, "no wait fraction or MFU in these records", ha="center", va="center", transform=ax.transAxes)
    elif waits or mfus:
        ax.legend(loc="upper left", fontsize=7)
    highest = max([v for _, v in waits + mfus], default=0.0)
    ax.set_ylim(0, min(100.0, max(10.0, 1.2 * highest)))  # at least 0-10 %: a small share looks small


def _worker_panel(ax: Axes, train: list[StepRecord], decisions: list[AutoscaleRecord]) -> None:
    from matplotlib.ticker import MaxNLocator

    counted = [r for r in train if r.workers]
    colors = {}
    for (kind, label), style in zip(WORKER_KINDS, ("-", "--"), strict=True):  # dashed: equal counts stay visible
        points = [(r.step, r.workers[kind]) for r in counted if kind in r.workers]
        if points:
            xs, ns = [s for s, _ in points], [n for _, n in points]
            (line,) = ax.step(xs, ns, where="mid", ls=style, lw=2.2 if style == "-" else 1.4, label=label)
            colors[kind] = line.get_color()
    for d in decisions:
        marker = "x" if d.outcome == "failed" else ("^" if d.after > d.before else "v")
        ax.plot([d.step - 0.5], [d.after], marker=marker, ms=9, ls="none", color=colors.get(d.role, "black"))
    if decisions:
        ax.plot([], [], "k^", ls="none", label="autoscaler: up / down / failed")
    if not (counted or decisions):
        ax.text(0.5, 0.5, "no worker counts in these records", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(loc="upper left", fontsize=7)
    ax.set_ylabel("workers")
    most = max([n for r in counted for n in r.workers.values()] + [d.after for d in decisions], default=1)
    ax.set_ylim(0, most + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def pipeline_table(train: list[StepRecord], decisions: list[AutoscaleRecord], max_rows: int = 50) -> str:
    """Per step (the last ``max_rows``; 0: all): the phases of `PHASES` in seconds, the wait
    fraction, MFU and TFLOP/s per device, the rollouts' mean seconds and the workers; then the
    run's shares of time per phase, and the autoscaler's decisions."""
    header = ["step", "wall s", *(name.split()[0] for name, _ in PHASES), "wait%", "mfu%", "TFLOP/s"]
    header += ["rollout s", "model s", "gens", "gws"]
    rows = [header]
    shown = train[-max_rows:] if max_rows else train
    for r in shown:
        rows.append(
            [
                str(r.step),
                f"{r.timing.step_s:.2f}",
                *(f"{phase(r):.2f}" for _, phase in PHASES),
                _cell(None if r.wait_fraction is None else 100 * r.wait_fraction, ".1f"),
                _cell(None if r.mfu is None else 100 * r.mfu, ".2f"),
                _cell(r.model_tflops, ".3g"),
                _cell(r.rollout_s, ".2f"),
                _cell(r.generation_s, ".2f"),
                *(str(r.workers[k]) if k in r.workers else "-" for k, _ in WORKER_KINDS),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    if len(shown) < len(train):
        lines.append(f"(the last {len(shown)} of {len(train)} steps; --rows 0 shows every one)")
    lines.append(_shares(train))
    lines += [
        f"autoscaler after step {d.step - 1}: {d.role} {d.before} -> {d.after} ({d.outcome}): {d.reason}"
        for d in decisions
    ]
    return "\n".join(lines)


def _shares(train: list[StepRecord]) -> str:
    total = sum(r.timing.step_s for r in train)
    shares = ", ".join(f"{name} {100 * sum(p(r) for r in train) / total:.0f}%" for name, p in PHASES) if total else "-"
    mfus = [r.mfu for r in train if r.mfu is not None]
    mfu = f"; mean MFU {100 * sum(mfus) / len(mfus):.2f}%" if mfus else "; MFU not recorded"
    return f"all {len(train)} steps, {total:.1f} s: {shares}{mfu}"

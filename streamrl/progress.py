"""The live progress display of ``streamrl up``: polls the trainer's ``/status`` once a second.

On a terminal it draws a table (step, state, reward with a sparkline, buffer depth per target
offset, groups in flight, staleness, refit time, workers); otherwise (CI logs, pipes) it prints
one line per finished step.
"""

from __future__ import annotations

from types import TracebackType

import httpx
import msgspec
from rich.console import Console
from rich.live import Live
from rich.table import Table

from shared.auth import client_headers, load_api_token
from shared.records import StepRecord, TrainerStatus
from shared.run_config import RunConfig

_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0) -> str:
    out = []
    for v in values:
        x = 0.0 if hi <= lo else (min(max(v, lo), hi) - lo) / (hi - lo)
        out.append(_SPARK[min(len(_SPARK) - 1, int(x * (len(_SPARK) - 1) + 0.5))])
    return "".join(out)


def _offsets(depth: dict[str, int], step: int) -> str:
    if not depth:
        return "-"
    return " ".join(f"{'+' if int(t) - step >= 0 else ''}{int(t) - step}:{n}" for t, n in depth.items())


def utilisation(last: StepRecord) -> str:
    """The share of the step spent waiting for data and the trainer's MFU (with its TFLOP/s per
    device); "-" for a figure the record lacks (no MFU without a known peak: a CPU)."""
    wait = "-" if last.wait_fraction is None else f"{last.wait_fraction:.0%}"
    mfu = "-" if last.mfu is None else f"{last.mfu:.1%}"
    tflops = "" if last.model_tflops is None else f" ({last.model_tflops:.3g} TFLOP/s per device)"
    return f"waited {wait}  mfu {mfu}{tflops}"


class Progress:
    def __init__(self, trainer_url: str, cfg: RunConfig, *, enabled: bool = True) -> None:
        self.url = trainer_url
        self.cfg = cfg
        self.console = Console(stderr=True)
        self.live_mode = enabled and self.console.is_terminal
        self.enabled = enabled
        self.rewards: list[float] = []
        self.last_step = -1
        self.status: TrainerStatus | None = None
        self._live: Live | None = None
        self._headers = client_headers(load_api_token())  # /status is a control route

    def __enter__(self) -> Progress:
        if self.live_mode:
            self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)

    def update(self, final: bool = False) -> None:
        if not self.enabled:
            return
        try:
            r = httpx.get(f"{self.url}/status", headers=self._headers, timeout=2.0)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        try:
            self.status = msgspec.json.decode(r.content, type=TrainerStatus)
        except msgspec.DecodeError:
            return
        last = self.status.last
        if last is not None and last.step != self.last_step:
            self.last_step = last.step
            self.rewards.append(last.batch.reward_mean)
            if not self.live_mode:
                self.console.print(self._line(self.status, last), highlight=False)
        if self._live is not None:
            self._live.update(self._table())

    @staticmethod
    def _line(s: TrainerStatus, last: StepRecord) -> str:
        return (
            f"step {last.step + 1}/{s.max_num_steps}  reward {last.batch.reward_mean:.3f}  "
            f"loss {last.learner.loss:+.4f}  staleness {last.staleness.mean:.2f}  "
            f"buffer {_offsets(last.buffer.depth, last.step + 1)}  "
            f"wait {last.timing.wait_data_s:.1f}s train {last.timing.train_s:.1f}s "
            f"refit {last.refit.total_s:.2f}s  {utilisation(last)}"
        )

    def _table(self) -> Table:
        s = self.status
        t = Table(title=f"streamrl · run {self.cfg.run.run_id}", show_header=False, expand=False)
        t.add_column(style="bold cyan")
        t.add_column()
        if s is None:
            t.add_row("step", f"0/{self.cfg.grpo.max_num_steps}  (starting)")
            return t
        t.add_row("step", f"{s.step}/{s.max_num_steps}  ({s.state})")
        if self.rewards:
            t.add_row("reward", f"{self.rewards[-1]:.3f}  {sparkline(self.rewards[-40:])}")
        t.add_row("weight version", str(s.weight_version))
        t.add_row("buffer (target offset:groups)", _offsets(s.buffer_depth, s.step))
        t.add_row("in flight (target offset:groups)", _offsets(s.in_flight_groups, s.step))
        last = s.last
        if last is not None:
            t.add_row("staleness (mean/max)", f"{last.staleness.mean:.2f} / {last.staleness.max}")
            t.add_row(
                "step time: wait/train/refit",
                f"{last.timing.wait_data_s:.1f}s / {last.timing.train_s:.1f}s / {last.refit.total_s:.2f}s",
            )
            t.add_row("waited for data / MFU", utilisation(last))
            t.add_row("loss / grad norm", f"{last.learner.loss:+.4f} / {last.learner.grad_norm:.3f}")
            t.add_row("trajectories/s", f"{last.trajectories_per_s:.1f}")
        t.add_row("workers", ", ".join(f"{w.id}[{w.state} v{w.weight_version}]" for w in s.workers) or "-")
        if s.error:
            t.add_row("error", f"[red]{s.error}[/red]")
        return t

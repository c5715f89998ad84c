"""The live progress display of ``streamrl up``: polls the trainer's ``/status`` once a second.

On a terminal it draws a table (step, state, reward with a sparkline, buffer depth per target
offset, groups in flight, staleness, refit time, workers); otherwise (CI logs, pipes) it prints
one line per finished step.
"""

from __future__ import annotations

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from shared.auth import client_headers, load_api_token
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


class Progress:
    def __init__(self, trainer_url: str, cfg: RunConfig, *, enabled: bool = True) -> None:
        self.url = trainer_url
        self.cfg = cfg
        self.console = Console(stderr=True)
        self.live_mode = enabled and self.console.is_terminal
        self.enabled = enabled
        self.rewards: list[float] = []
        self.last_step = -1
        self.status: dict = {}
        self._live: Live | None = None
        self._headers = client_headers(load_api_token())  # /status is a control route

    def __enter__(self) -> Progress:
        if self.live_mode:
            self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, final: bool = False) -> None:
        if not self.enabled:
            return
        try:
            r = httpx.get(f"{self.url}/status", headers=self._headers, timeout=2.0)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        self.status = r.json()
        last = self.status.get("last") or {}
        if last and last.get("step", -1) != self.last_step:
            self.last_step = last["step"]
            self.rewards.append(float(last.get("reward_mean", 0.0)))
            if not self.live_mode:
                self.console.print(self._line(last), highlight=False)
        if self._live is not None:
            self._live.update(self._table())

    def _line(self, last: dict) -> str:
        s = self.status
        return (
            f"step {last['step'] + 1}/{s.get('max_num_steps')}  reward {last.get('reward_mean', 0):.3f}  "
            f"loss {last.get('loss', 0):+.4f}  staleness {last.get('staleness_mean', 0):.2f}  "
            f"buffer {_offsets(last.get('buffer_depth', {}), last['step'] + 1)}  "
            f"wait {last.get('time_wait_data_s', 0):.1f}s train {last.get('time_train_s', 0):.1f}s "
            f"refit {last.get('time_refit_s', 0):.2f}s"
        )

    def _table(self) -> Table:
        s = self.status
        last = s.get("last") or {}
        t = Table(title=f"streamrl · run {self.cfg.run.run_id}", show_header=False, expand=False)
        t.add_column(style="bold cyan")
        t.add_column()
        step = s.get("step", 0)
        t.add_row(
            "step", f"{step}/{s.get('max_num_steps', self.cfg.grpo.max_num_steps)}  ({s.get('state', 'starting')})"
        )
        if self.rewards:
            t.add_row("reward", f"{self.rewards[-1]:.3f}  {sparkline(self.rewards[-40:])}")
        t.add_row("weight version", str(s.get("weight_version", "-")))
        t.add_row("buffer (target offset:groups)", _offsets(s.get("buffer_depth", {}), step))
        t.add_row("in flight (target offset:groups)", _offsets(s.get("in_flight_groups", {}), step))
        if last:
            t.add_row("staleness (mean/max)", f"{last.get('staleness_mean', 0):.2f} / {last.get('staleness_max', 0)}")
            t.add_row(
                "step time: wait/train/refit",
                f"{last.get('time_wait_data_s', 0):.1f}s / {last.get('time_train_s', 0):.1f}s / "
                f"{last.get('time_refit_s', 0):.2f}s",
            )
            t.add_row("loss / grad norm", f"{last.get('loss', 0):+.4f} / {last.get('grad_norm', 0):.3f}")
            t.add_row("trajectories/s", f"{last.get('trajectories_per_s', 0):.1f}")
        workers = s.get("workers", [])
        t.add_row("workers", ", ".join(f"{w['id']}[{w['state']} v{w['weight_version']}]" for w in workers) or "-")
        if s.get("error"):
            t.add_row("error", f"[red]{s['error']}[/red]")
        return t

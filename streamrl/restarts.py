"""How often `streamrl up` restarts a service that died: at most ``supervisor.max_restarts``
times within ``supervisor.restart_window_s``, each after a backoff that starts at
``supervisor.restart_backoff_s`` and doubles with every restart still in the window (at most
60 s). A service that keeps dying fails the job instead of looping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sections.run import SupervisorSection

MAX_BACKOFF_S = 60.0


@dataclass
class RestartBudget:
    max_restarts: int
    window_s: float
    backoff_s: float
    times: list[float] = field(default_factory=list)  # when each restart in the window was granted

    @classmethod
    def from_config(cls, cfg: SupervisorSection) -> RestartBudget:
        return cls(cfg.max_restarts, cfg.restart_window_s, cfg.restart_backoff_s)

    def grant(self, now: float) -> float | None:
        """The delay before the next restart, counted as granted; None when the budget is spent."""
        self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.max_restarts:
            return None
        delay: float = min(self.backoff_s * 2 ** len(self.times), MAX_BACKOFF_S)
        self.times.append(now)
        return delay

    def spent(self) -> str:
        return f"{len(self.times)} restart(s) within {self.window_s:.0f}s (supervisor.max_restarts {self.max_restarts})"

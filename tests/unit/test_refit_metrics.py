"""The trainer's Prometheus view of refit membership: how many generators confirmed the last
refit, and a counter of generators dropped from a refit (left or began draining)."""

import pytest

from services.trainer.observe import TrainerMetrics
from services.trainer.refit import RefitReport
from tests.support.records import step_record

pytestmark = pytest.mark.unit


def _sample(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_refit_membership_metrics_follow_the_step_records():
    m = TrainerMetrics()
    for step, confirmed, dropped in ((0, ["g-0", "g-1"], []), (1, ["g-0"], ["g-1"]), (2, ["g-0"], [])):
        report = RefitReport(step + 1, 0.1, 0.2, 0.3, generators=confirmed, dropped=dropped)
        m.observe_record(step_record(step, refit=report))
    text = m.render().decode()
    assert _sample(text, "streamrl_trainer_refit_generators") == 1.0
    assert _sample(text, "streamrl_trainer_refit_dropped_generators_total") == 1.0

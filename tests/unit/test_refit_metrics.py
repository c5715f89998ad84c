"""The trainer's Prometheus view of refit membership: how many generators confirmed the last
refit, and a counter of generators dropped from a refit (left or began draining)."""

import pytest

from services.trainer.observe import TrainerMetrics

pytestmark = pytest.mark.unit


def _sample(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_refit_membership_metrics_follow_the_step_records():
    m = TrainerMetrics()
    m.observe_record({"kind": "train", "step": 0, "refit_generators": ["g-0", "g-1"], "refit_dropped_generators": []})
    m.observe_record({"kind": "train", "step": 1, "refit_generators": ["g-0"], "refit_dropped_generators": ["g-1"]})
    m.observe_record({"kind": "train", "step": 2, "refit_generators": ["g-0"], "refit_dropped_generators": []})
    text = m.render().decode()
    assert _sample(text, "streamrl_trainer_refit_generators") == 1.0
    assert _sample(text, "streamrl_trainer_refit_dropped_generators_total") == 1.0

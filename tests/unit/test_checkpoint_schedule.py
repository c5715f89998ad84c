"""When the trainer checkpoints: every ``save_period`` steps, at the last step, and with
``save_period_s`` after the first step that ends that long after the last save (a clock the test
sets, not the machine's)."""

from __future__ import annotations

import pytest

from services.trainer import checkpoint
from services.trainer.checkpoint import Checkpointer
from shared.sections.trainer import CheckpointSection


@pytest.fixture
def clock(monkeypatch):
    now = {"t": 1000.0}
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: now["t"])
    return now


def _checkpointer(tmp_path, **cfg) -> Checkpointer:
    section = CheckpointSection(**cfg)
    return Checkpointer(section, tmp_path, None, None, max_num_steps=100, stream_retention_s=0.0)  # type: ignore[arg-type]


def test_by_steps_only_without_a_period_in_seconds(tmp_path, clock):
    ckpt = _checkpointer(tmp_path, save_period=10)
    clock["t"] += 1e6
    assert [s for s in range(1, 101) if ckpt.due(s)] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]


def test_a_period_in_seconds_makes_the_first_step_after_it_due(tmp_path, clock):
    ckpt = _checkpointer(tmp_path, save_period=50, save_period_s=600.0)
    clock["t"] += 599.0
    assert not ckpt.due(3)
    clock["t"] += 1.0  # 600 s since the trainer started
    assert ckpt.due(4)
    ckpt._last_save = clock["t"]  # what saving step 4 records (after_step sets it)
    clock["t"] += 300.0
    assert not ckpt.due(5) and ckpt.due(50)  # the step period still holds

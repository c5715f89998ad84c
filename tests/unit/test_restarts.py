"""The supervisor's restart budget: a doubling backoff, a cap per window, and a window that slides."""

import pytest

from streamrl.restarts import MAX_BACKOFF_S, RestartBudget

pytestmark = pytest.mark.unit


def test_backoff_doubles_and_the_cap_fails_the_next_crash():
    b = RestartBudget(max_restarts=3, window_s=600.0, backoff_s=1.0)
    assert [b.grant(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 4.0]
    assert b.grant(30.0) is None
    assert "3 restart(s) within 600s" in b.spent()


def test_restarts_older_than_the_window_no_longer_count():
    b = RestartBudget(max_restarts=2, window_s=100.0, backoff_s=1.0)
    assert b.grant(0.0) == 1.0 and b.grant(50.0) == 2.0
    assert b.grant(99.0) is None
    assert b.grant(151.0) == 1.0  # both earlier ones left the window


def test_the_backoff_is_capped_and_zero_restarts_fail_at_once():
    b = RestartBudget(max_restarts=20, window_s=1e9, backoff_s=10.0)
    assert max(b.grant(float(t)) for t in range(10)) == MAX_BACKOFF_S
    assert RestartBudget(max_restarts=0, window_s=600.0, backoff_s=1.0).grant(0.0) is None

"""The gateway_scale section's table and verdict (the measurement itself is `streamrl bench`)."""

import msgspec
import pytest

from streamrl.bench import gateway_scale as bgs

pytestmark = pytest.mark.unit


def _row(scenario, n, p99, errors=0, memory=80.0):
    return bgs.ScaleRow(
        scenario=scenario,
        sessions=n,
        calls=3 * n,
        errors=errors,
        proxy_p50_ms=p99 / 4,
        proxy_p99_ms=p99,
        direct_p50_ms=1.0,
        direct_p99_ms=2.0,
        cpu_us_per_call=700.0,
        memory_per_session_kb=memory,
        load_avg=1.0,
    )


def _text(*rows):
    results = bgs.summarize(list(rows), date="2026-12-02", machine="test", placement="pinned")
    return bgs.render_section(results)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_target_is_judged_on_steady_traffic_at_1024_sessions_and_the_burst_is_reported():
    text = _text(_row("burst", 1024, 900.0), _row("steady", 1024, 31.0, memory=None))
    assert "steady traffic 31 ms (met), burst 900 ms (not met); met for an agentic run's traffic" in _flat(text)
    assert "| steady | 1024 | 3072 / 0 | 7.8 | 31.0 | 1.0 | 2.0 | 700 | - | 1.0 |" in text


@pytest.mark.parametrize(("p99", "errors"), [(51.0, 0), (20.0, 3)])
def test_a_slow_or_failing_steady_round_misses_the_target(p99, errors):
    text = _text(_row("steady", 1024, p99, errors=errors))
    assert _flat(text).endswith("NOT met for an agentic run's traffic.")


def test_the_framework_routes_row_is_set_against_the_same_size():
    rows = [
        _row("burst", 1024, 900.0),
        msgspec.structs.replace(_row("burst", 1024, 1200.0), scenario="burst, routes only"),
    ]
    rows[1].cpu_us_per_call = 1000.0
    text = _flat(_text(*rows))
    assert "gateway CPU per call 700 us answered in front of the framework (`SessionCalls`) against 1000 us" in text
    assert "(0.70x); overhead p99 900.0 against 1200.0 ms." in text

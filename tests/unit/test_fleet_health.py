"""`shared.fleet_health.assess_fleet`, the generator fleet's health rule, on made-up heartbeats and
call summaries; and the gateway's window of calls it is fed from."""

from __future__ import annotations

import pytest

from services.gym_gateway.call_window import CallWindow
from shared.fleet_health import CallSummary, GeneratorHealth, HealthPolicy, assess_fleet, merge_calls
from tests.support.messages import make_heartbeat

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
POLICY = HealthPolicy()  # the defaults: 10 calls, 25 % errors, 3x the peers' latency, 30 s to recover


def beat(gid: str, state: str = "ready", **fields):
    return make_heartbeat(gid, state=state, weight_version=0, **fields)


def seen(
    gid: str, *, calls: int = 20, errors: int = 0, latency_s: float | None = 0.01, at: float = NOW, **fields
) -> CallSummary:
    """Gateway gw-0's window on ``gid`` made at ``at``: ``calls`` calls, ``errors`` of them failed,
    the others timed at ``latency_s`` per token."""
    fields.setdefault("gateway_id", "gw-0")
    return CallSummary(
        worker_id=gid,
        calls=calls,
        errors=errors,
        latency_calls=calls - errors if latency_s is not None else 0,
        latency_median_s=latency_s,
        window_start=at - 60,
        window_end=at,
        **fields,
    )


def judge(beats, calls, *, now: float = NOW, previous=None) -> dict[str, GeneratorHealth]:
    return assess_fleet(beats, calls, now=now, policy=POLICY, previous=previous)


def test_a_generator_slow_against_two_healthy_peers_is_degraded_with_the_factor():
    beats = [beat("g0"), beat("g1"), beat("g2")]
    out = judge(beats, [seen("g0"), seen("g1", latency_s=0.012), seen("g2", latency_s=0.05)])
    assert out["g2"].state == "degraded"
    assert out["g2"].reason == "4.5x the fleet's median latency per token"  # 0.05 / median(0.01, 0.012)
    assert out["g2"].latency_factor == pytest.approx(0.05 / 0.011)
    assert out["g0"].state == out["g1"].state == "serving"
    assert out["g0"].latency_factor == pytest.approx(0.01 / 0.031)  # its peers: g1 and the slow g2


def test_a_generator_a_little_slower_than_its_peers_keeps_serving():
    out = judge([beat("g0"), beat("g1")], [seen("g0"), seen("g1", latency_s=0.025)])
    assert out["g1"].state == "serving" and "2.5x" in out["g1"].reason


def test_an_erroring_generator_is_degraded_and_a_blip_is_not():
    beats = [beat("g0"), beat("g1"), beat("g2")]
    out = judge(beats, [seen("g0"), seen("g1", calls=10, errors=6), seen("g2", calls=10, errors=2)])
    assert out["g1"].state == "degraded"
    assert out["g1"].reason == "errors 6/10 calls in the last 60 s"
    assert out["g1"].errors == 6 and out["g1"].calls == 10
    assert out["g2"].state == "serving"  # 2 of 10: a blip


def test_too_few_calls_are_not_judged():
    out = judge([beat("g0"), beat("g1")], [seen("g0"), seen("g1", calls=5, errors=5, latency_s=None)])
    assert out["g1"].state == "serving" and "too few to judge" in out["g1"].reason


def test_a_lone_slow_generator_has_no_peers_to_be_slow_against():
    out = judge([beat("g0")], [seen("g0", latency_s=5.0)])
    assert out["g0"].state == "serving" and out["g0"].latency_factor is None
    # a peer with too few calls is no peer either
    out = judge([beat("g0"), beat("g1")], [seen("g0", latency_s=5.0), seen("g1", calls=3)])
    assert out["g0"].state == "serving"


def test_a_draining_generator_is_draining_and_forgotten_once_it_left():
    out = judge([beat("g0"), beat("g1", "draining")], [seen("g0"), seen("g1", latency_s=1.0)])
    assert out["g1"].state == "draining" and out["g0"].state == "serving"
    # its heartbeat is gone after the drain: scaled down on purpose, not lost
    assert "g1" not in judge([beat("g0")], [seen("g0"), seen("g1")], now=NOW + 5, previous=out)
    # a gateway saw it drain even if no verdict recorded it
    assert "g1" not in judge([beat("g0")], [seen("g0"), seen("g1", heartbeat_state="draining")])


def test_lost_without_a_heartbeat_when_failed_or_when_every_call_is_refused():
    first = judge([beat("g0"), beat("g1")], [seen("g0"), seen("g1")])
    out = judge([beat("g0")], [seen("g0")], now=NOW + 12, previous=first)  # g1's heartbeat expired
    assert out["g1"].state == "lost" and "no live heartbeat" in out["g1"].reason
    assert judge([beat("g0")], [seen("g0"), seen("g1", heartbeat_state="ready")])["g1"].state == "lost"
    # forgotten after forget_lost_s
    assert "g1" not in judge([beat("g0")], [], now=NOW + 12 + POLICY.forget_lost_s + 1, previous=out)

    failed = judge([beat("g0", "failed", error="CUDA error: an illegal memory access")], [])
    assert failed["g0"].state == "lost" and "illegal memory access" in failed["g0"].reason

    refused = seen("g0", calls=4, errors=4, latency_s=None, connection_errors=4)
    out = judge([beat("g0")], [refused])
    assert out["g0"].state == "lost" and out["g0"].reason == "all 4 calls in the last 60 s failed to connect"


def test_a_generator_mid_refit_is_not_judged_slow():
    for state in ("loading", "paused", "starting", "awaiting_weights"):
        out = judge([beat("g0"), beat("g1"), beat("g2", state)], [seen("g0"), seen("g1"), seen("g2", latency_s=1.0)])
        assert out["g2"].state == "serving" and state in out["g2"].reason


def test_a_degraded_generator_serves_again_only_after_staying_healthy_for_recover_s():
    beats = [beat("g0"), beat("g1"), beat("g2")]

    def at(t: float, g2_latency_s: float = 0.01, previous=None, hbs=beats) -> dict[str, GeneratorHealth]:
        calls = [seen("g0", at=NOW + t), seen("g1", at=NOW + t), seen("g2", latency_s=g2_latency_s, at=NOW + t)]
        return judge(hbs, calls, now=NOW + t, previous=previous)

    h = at(0, 0.1)
    assert h["g2"].state == "degraded"
    since = h["g2"].since
    # healthy again: still degraded (recovering) until recover_s have passed
    h = at(10, previous=h)
    assert h["g2"].state == "degraded" and h["g2"].since == since
    assert h["g2"].reason.startswith("recovering: healthy for 0 s of 30 s; was 10.0x")
    h = at(30, previous=h)
    assert h["g2"].state == "degraded" and "healthy for 20 s" in h["g2"].reason
    # slow again while recovering: the clock starts over
    h = at(35, 0.1, previous=h)
    assert h["g2"].state == "degraded" and h["g2"].healthy_since is None
    h = at(65, previous=at(36, previous=h))
    assert h["g2"].state == "degraded"
    h = at(66, previous=h)
    assert h["g2"].state == "serving" and h["g2"].since == NOW + 66
    # a refit does not end a degradation, and a restarted process starts clean
    h = at(70, 0.1, previous=h)
    assert at(71, previous=h, hbs=[*beats[:2], beat("g2", "loading")])["g2"].state == "degraded"
    restarted = [*beats[:2], beat("g2", "starting", started_at=NOW + 72)]
    assert at(73, 0.1, previous=h, hbs=restarted)["g2"].state == "serving"


def test_calls_of_every_gateway_add_up_and_stale_windows_drop_out():
    merged = merge_calls(
        [
            seen("g0", calls=10, errors=1, latency_s=0.01),
            seen("g0", calls=30, errors=3, latency_s=0.02, gateway_id="gw-1"),
            seen("g0", calls=50, errors=50, gateway_id="gw-dead", at=NOW - 61),
        ],
        now=NOW,
        window_s=60.0,
    )
    g0 = merged["g0"]
    assert (g0.calls, g0.errors, g0.latency_calls) == (40, 4, 36)
    assert g0.latency_median_s == 0.02  # the calls' weighted median of the gateways' medians


def test_the_call_window_counts_outcomes_and_latency_per_token():
    w = CallWindow(window_s=60.0)
    for latency_s in (0.1, 0.2, 0.3):
        w.ok("g0", latency_s, tokens=10)
    w.ok("g0", 5.0, tokens=10, timed=False)  # a refit ran under it
    w.ok("g0", 0.02, tokens=0)  # no tokens: per call
    w.error("g0", "http")
    w.error("g0", "connection")
    w.error("g0", "timeout")
    [s] = w.summaries("gw-0", {"g0": "ready"})
    assert (s.gateway_id, s.worker_id, s.heartbeat_state) == ("gw-0", "g0", "ready")
    assert (s.calls, s.errors, s.connection_errors, s.timeouts, s.latency_calls) == (8, 3, 1, 1, 4)
    assert s.latency_median_s == pytest.approx(0.02)  # of 0.01, 0.02, 0.02, 0.03
    w.forget("g0")
    assert w.summaries("gw-0", {}) == []

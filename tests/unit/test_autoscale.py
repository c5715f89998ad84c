"""The autoscaler's policy (`services.trainer.autoscale`) step by step, and the bounds the config
refuses (`shared.sections.autoscale`)."""

import msgspec
import pytest

from services.trainer.autoscale import AutoscalePolicy, Signals
from shared.config_error import ConfigError
from shared.run_config import RunConfig
from shared.sections.autoscale import AutoscaleSection

pytestmark = pytest.mark.unit


def policy(**over) -> AutoscalePolicy:
    tree = {"enabled": True, "generator": {"min": 1, "max": 4}, "gym_gateway": {"min": 1, "max": 8}, **over}
    return AutoscalePolicy(msgspec.convert(tree, AutoscaleSection))


def sig(step, wait, gen=1, gw=2, **kw) -> Signals:
    return Signals(step=step, wait_fraction=wait, counts={"generator": gen, "gym_gateway": gw}, **kw)


def test_starved_steps_scale_up_the_role_where_work_queues_by_the_factor_that_covers_the_wait():
    p = policy()
    assert p.decide(sig(0, 0.5, tasks_lag=12)) == []  # one starved step is not enough (up_after_steps: 2)
    [d] = p.decide(sig(1, 0.5, tasks_lag=12))
    assert (d.role, d.before, d.after) == ("gym_gateway", 2, 4)  # waited half the step: twice the workers
    assert "12.0 tasks waiting for a gateway slot" in d.reason and "waited 50% of the last 2 steps" in d.reason


def test_gateways_grow_by_the_slots_the_waiting_tasks_need_when_that_is_more():
    p = policy()
    p.decide(sig(0, 0.2, gw=3, tasks_lag=14, gateway_slots=4))
    [d] = p.decide(sig(1, 0.2, gw=3, tasks_lag=14, gateway_slots=4))
    assert (d.before, d.after) == (3, 7)  # 14 tasks / 4 slots: 4 more; the wait alone says 4
    assert d.reason.endswith("3 -> 7: slots for the waiting tasks (4 a worker)")


def test_requests_waiting_in_the_engines_point_at_the_generators():
    p = policy()
    p.decide(sig(0, 0.3, generator_queue=5, gateway_utilization=1.0))
    [d] = p.decide(sig(1, 0.3, generator_queue=5, gateway_utilization=1.0))
    assert (d.role, d.before, d.after) == ("generator", 1, 2)
    assert "requests waiting per generator" in d.reason


def test_starved_with_nothing_queued_outside_the_engines_adds_generators():
    p = policy()
    p.decide(sig(0, 0.2, gateway_utilization=0.4))
    [d] = p.decide(sig(1, 0.2, gateway_utilization=0.4))
    assert d.role == "generator" and "generation is the bottleneck" in d.reason


def test_scale_up_stops_at_the_bound_and_waits_out_the_cooldown():
    p = policy(cooldown_steps=4)
    p.decide(sig(0, 0.9, gw=6, tasks_lag=50))
    [d] = p.decide(sig(1, 0.9, gw=6, tasks_lag=50))
    assert d.after == 8  # 2x would be 12: max is 8
    assert p.decide(sig(2, 0.6, gw=7, tasks_lag=50)) == []  # the steps before the change are forgotten
    assert p.decide(sig(3, 0.6, gw=7, tasks_lag=50)) == []  # two starved steps again, but cooling down
    assert p.decide(sig(4, 0.6, gw=7, tasks_lag=50)) == []
    [d] = p.decide(sig(5, 0.6, gw=7, tasks_lag=50))
    assert (d.before, d.after) == (7, 8)
    for step in range(6, 12):
        assert p.decide(sig(step, 0.3, gw=8, tasks_lag=50)) == []  # it helped; at max: nothing more to ask


def test_a_scale_up_that_did_not_shorten_the_wait_is_undone_and_not_tried_again():
    p = policy(cooldown_steps=0)
    p.decide(sig(0, 0.3, gw=4, tasks_lag=3))
    [d] = p.decide(sig(1, 0.3, gw=4, tasks_lag=3))
    assert (d.before, d.after) == (4, 6)
    assert p.decide(sig(2, 0.3, gw=6, tasks_lag=2)) == []  # ran on rollouts four workers started: not judged
    assert p.decide(sig(3, 0.28, gw=6, gateway_utilization=0.6)) == []  # judged on two steps
    [d] = p.decide(sig(4, 0.28, gw=6, gateway_utilization=0.6))  # no task waits, yet 30% -> 28%
    assert (d.role, d.before, d.after) == ("gym_gateway", 6, 4)
    assert d.reason == (
        "undo: 4 -> 6 did not shorten the wait (30% of a step before, 28% after): "
        "more gym_gateway workers do not help here"
    )
    for step in range(5, 20):  # starved as before: the same wait, so no second try
        assert p.decide(sig(step, 0.3, gw=4, tasks_lag=3)) == []
    [d] = p.decide(sig(20, 0.6, gw=4, tasks_lag=9))  # the wait doubled: something changed, try again
    assert (d.before, d.after) == (4, 8)


def test_a_scale_up_that_leaves_tasks_waiting_was_too_small_and_the_next_goes_on():
    p = policy(cooldown_steps=0)
    p.decide(sig(0, 0.3, gw=2, tasks_lag=6))
    [d] = p.decide(sig(1, 0.3, gw=2, tasks_lag=6))
    assert (d.before, d.after) == (2, 3)
    assert p.decide(sig(2, 0.35, gw=3, tasks_lag=6)) == []  # rollouts got slower meanwhile
    assert p.decide(sig(3, 0.35, gw=3, tasks_lag=5)) == []
    [d] = p.decide(sig(4, 0.35, gw=3, tasks_lag=5))  # not undone: tasks still wait for a slot
    assert (d.before, d.after) == (3, 5) and d.reason.startswith("starved")


def test_an_idle_run_scales_down_one_at_a_time_only_where_there_is_slack():
    p = policy(down_after_steps=3, cooldown_steps=0)
    busy = {"gateway_utilization": 0.7}  # 4 -> 3 gateways would be 93% busy: above 75%
    for step in range(6):
        assert p.decide(sig(step, 0.0, gen=1, gw=4, **busy)) == []  # generators at min, gateways without slack
    # Two generators: one goes; the gateways' window (two busy steps and a quiet one) has no slack yet.
    [d] = p.decide(sig(6, 0.0, gen=2, gw=4, gateway_utilization=0.3))
    assert (d.role, d.before, d.after) == ("generator", 2, 1)
    # The next decision judges the new counts over three steps of their own: then a gateway goes.
    assert p.decide(sig(7, 0.0, gen=1, gw=4, gateway_utilization=0.3)) == []
    assert p.decide(sig(8, 0.0, gen=1, gw=4, gateway_utilization=0.3)) == []
    [d] = p.decide(sig(9, 0.0, gen=1, gw=4, gateway_utilization=0.3))
    assert (d.role, d.before, d.after) == ("gym_gateway", 4, 3) and "would be 40% busy" in d.reason


def test_a_count_that_starved_the_run_is_not_scaled_down_to_again():
    p = policy(down_after_steps=2, cooldown_steps=0, starved_memory_steps=10, gym_gateway={"min": 1, "max": 4})
    p.decide(sig(0, 0.5, gw=3, tasks_lag=9))
    [d] = p.decide(sig(1, 0.5, gw=3, tasks_lag=9))  # 3 gateways starved the trainer: 4
    assert (d.before, d.after) == (3, 4)
    for step in range(2, 12):
        assert all(d.role != "gym_gateway" for d in p.decide(sig(step, 0.0, gw=4)))
    downs = [d for step in range(12, 14) for d in p.decide(sig(step, 0.0, gw=4))]
    assert ("gym_gateway", 4, 3) in [(d.role, d.before, d.after) for d in downs]  # the memory ran out


def test_steps_that_alternate_a_long_wait_with_a_staged_batch_are_starved_on_average():
    p = policy()
    assert p.decide(sig(0, 0.0, tasks_lag=4)) == []
    [d] = p.decide(sig(1, 0.4, tasks_lag=4))  # mean 20%: starved; the lag is the steps' mean too
    assert (d.role, d.before, d.after) == ("gym_gateway", 2, 3) and "waited 20% of the last 2 steps" in d.reason
    assert "4.0 tasks waiting" in d.reason


def test_one_step_that_waited_holds_a_scale_down():
    p = policy(down_after_steps=3, cooldown_steps=0)
    p.decide(sig(0, 0.0, gen=2, gw=1))
    p.decide(sig(1, 0.0, gen=2, gw=1))
    assert p.decide(sig(2, 0.05, gen=2, gw=1)) == []  # neither starved (mean 1.7%) nor fed (one step waited 5%)
    assert p.decide(sig(3, 0.0, gen=2, gw=1)) == []
    assert p.decide(sig(4, 0.0, gen=2, gw=1)) == []
    [d] = p.decide(sig(5, 0.0, gen=2, gw=1))
    assert (d.role, d.before, d.after) == ("generator", 2, 1) and "each of the last 3 steps" in d.reason


def test_degraded_generators_are_replaced_up_to_the_bound():
    p = policy(cooldown_steps=0)
    [d] = p.decide(sig(0, 0.05, gen=2, degraded_generators=1))
    assert (d.role, d.before, d.after) == ("generator", 2, 3) and d.reason.startswith("replacing 1 degraded")
    assert p.decide(sig(1, 0.05, gen=3, degraded_generators=1)) == []  # replaced: two serve again
    [d] = p.decide(sig(2, 0.05, gen=3, degraded_generators=2))
    assert (d.before, d.after) == (3, 4)
    assert p.decide(sig(3, 0.05, gen=4, degraded_generators=3)) == []  # at max


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"generator": {"min": 3, "max": 2}}, "autoscale.generator.min (3) is above autoscale.generator.max (2)"),
        ({"gym_gateway": {"min": 0}}, "autoscale.gym_gateway.min must be >= 1"),
        ({"enabled": True, "gym_gateway": {"min": 2, "max": 4}}, "gym_gateway.num_workers (1) is outside"),
        ({"scale_up_wait_fraction": 0.01}, "autoscale.scale_down_wait_fraction must be >= 0 and below"),
        ({"up_after_steps": 0}, "autoscale.up_after_steps must be >= 1"),
        ({"max_gateway_utilization": 1.5}, "autoscale.max_gateway_utilization"),
    ],
)
def test_bounds_that_cannot_hold_are_refused_naming_the_key(tree, message):
    cfg = msgspec.convert({"autoscale": tree}, RunConfig)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        cfg.check()

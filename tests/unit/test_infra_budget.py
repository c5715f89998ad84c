"""The infrastructure-failure budget: the failed share over a sliding window of steps, the
reason it names, no bound when null."""

from services.trainer.infra_budget import InfraFailureBudget
from tests.support.messages import make_trajectory


def _step(failed_reasons: list[str], ok: int) -> tuple[list, list]:
    failed = [
        make_trajectory(f"g/{i}", [], status="failed", fallback_reason=f"{r}: gone")
        for i, r in enumerate(failed_reasons)
    ]
    good = [make_trajectory(f"g/{len(failed) + i}", []) for i in range(ok)]
    return failed + good, failed


def test_the_share_is_over_the_window_and_the_reason_names_classes_and_counts():
    budget = InfraFailureBudget(0.5, window_steps=2)
    trajs, failed = _step(["transport", "transport", "sandbox"], ok=1)
    assert budget.observe(0, trajs, failed) == 0.75
    assert budget.exceeded() == (
        "3 of 4 rollouts of step 0 failed for an infrastructure reason (transport: 2, sandbox: 1): 75.0% is over "
        "grpo.max_infra_failure_fraction 0.5; the run is paused before training on the rest (fix the cause, "
        "then `streamrl resume`)"
    )
    trajs, failed = _step([], ok=4)
    assert budget.observe(1, trajs, failed) == 3 / 8 and budget.exceeded() is None  # steps 0-1
    trajs, failed = _step(["timeout"] * 3, ok=1)
    assert budget.observe(2, trajs, failed) == 3 / 8  # steps 1-2: step 0 has left the window
    trajs, failed = _step(["timeout"] * 2, ok=2)
    assert budget.observe(3, trajs, failed) == 5 / 8
    assert budget.exceeded().startswith("5 of 8 rollouts of steps 2-3 failed for an infrastructure reason (timeout: 5)")
    budget.reset()
    assert budget.fraction() == 0.0 and budget.exceeded() is None


def test_a_null_bound_never_pauses():
    budget = InfraFailureBudget(None, window_steps=3)
    trajs, failed = _step(["transport"] * 4, ok=0)
    assert budget.observe(0, trajs, failed) == 1.0 and budget.exceeded() is None

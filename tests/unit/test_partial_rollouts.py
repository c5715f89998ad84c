"""Partial rollouts across refits: a generation a refit interrupts is continued on the new weights
(`services.generator.partial`), each token's version is recorded, staleness is bounded by the
oldest token's version and each step reports how many versions its trajectories span.

The continuation logic runs here against a scripted engine (the real engines' interrupt is in the
engine contract, the whole path through a real generator in tests/integration/
test_generator_weights.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.generator.engine import ChoiceOutput, GenerationParams
from services.generator.partial import continue_interrupted
from services.generator.runtime import LocalPause, Runtime
from services.gym_gateway.envs.base import Outcome
from services.gym_gateway.proxy import Session
from services.gym_gateway.worker import assemble
from services.trainer.buffer import Group, SampleResult
from services.trainer.step_record import staleness, trajectory_spans
from shared.protocol import SamplingParams, Trajectory, make_turn
from tests.support.messages import make_task, make_trajectory

pytestmark = pytest.mark.unit


class ScriptedEngine:
    """Generates token ``len(prompt)`` (+ 1000 * version) per step; a call is interrupted after
    the number of tokens its script says (None: runs to max_tokens)."""

    errored = False

    def __init__(self, runtime_ref: list[Runtime], cuts: list[int | None]) -> None:
        self.runtime_ref = runtime_ref
        self.cuts = cuts
        self.calls: list[tuple[list[int], GenerationParams]] = []

    async def generate(self, prompt: list[int], params: GenerationParams, request_id: str) -> list[ChoiceOutput]:
        self.calls.append((list(prompt), params))
        rt = self.runtime_ref[0]
        cut = self.cuts.pop(0)
        n = params.max_tokens if cut is None else min(cut, params.max_tokens)
        tokens = [len(prompt) + i + 1000 * rt.weight_version for i in range(n)]
        if cut is not None and cut < params.max_tokens:
            await rt.pause(LocalPause.REFIT, "keep")  # the refit interrupts this call here
            rt.weight_version += 1
            asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(rt.resume(LocalPause.REFIT)))
            reason = "abort"
        else:
            reason = "length"
        return [ChoiceOutput(index=0, token_ids=tokens, logprobs=[-0.5] * n, finish_reason=reason)]

    async def pause(self, mode: str) -> None:
        return None

    async def resume(self) -> None:
        return None


def _runtime(cuts: list[int | None]) -> tuple[Runtime, ScriptedEngine]:
    ref: list[Runtime] = []
    engine = ScriptedEngine(ref, cuts)
    rt = Runtime(engine, "g0", max_concurrent_requests=4, drain_timeout_s=1.0)  # type: ignore[arg-type]
    rt.started = True
    rt.weight_version = 3
    ref.append(rt)
    return rt, engine


async def test_a_choice_interrupted_by_two_refits_is_continued_to_its_budget():
    rt, engine = _runtime([4, 3, None])
    params = GenerationParams(temperature=1.0, top_p=1.0, max_tokens=10, seed=7)
    before = rt.interrupts
    first = await engine.generate([1, 2], params, "r")
    [c] = await continue_interrupted(rt, [1, 2], params, "r", first, before, first_version=3)
    assert c.finish_reason == "length" and len(c.token_ids) == len(c.logprobs) == 10
    assert c.version_spans == ((0, 3), (4, 4), (7, 5))
    # each continuation's prompt is the prompt plus everything generated so far, within the budget
    assert [(p, q.max_tokens, q.n) for p, q in engine.calls[1:]] == [
        ([1, 2, *c.token_ids[:4]], 6, 1),
        ([1, 2, *c.token_ids[:7]], 3, 1),
    ]
    assert engine.calls[1][1].seed != engine.calls[2][1].seed
    assert c.token_ids[4] // 1000 == 4 and c.token_ids[7] // 1000 == 5 and rt.interrupts == 2


async def test_an_abort_without_a_refit_is_not_continued():
    rt, _ = _runtime([])
    aborted = ChoiceOutput(index=0, token_ids=[5], logprobs=[-1.0], finish_reason="abort")
    params = GenerationParams(temperature=1.0, top_p=1.0, max_tokens=10)
    [c] = await continue_interrupted(rt, [1], params, "r", [aborted], rt.interrupts, first_version=3)
    assert c == aborted


def _traj(task_id: str, turns, launch_version: int = 0) -> Trajectory:
    return make_trajectory(
        task_id, turns, group_id="g", index=int(task_id[-1]), target_step=5, launch_version=launch_version
    )


def _turn(version: int, spans=()):
    return make_turn(
        prompt_ids=[1, 2],
        context_len=0,
        generated_ids=[3, 4, 5],
        generated_logprobs=[-0.1] * 3,
        weight_version=version,
        version_spans=list(spans),
    )


def test_turn_versions_come_from_its_spans():
    assert _turn(3).versions() == [3]
    assert _turn(3, [(0, 3), (2, 4)]).versions() == [3, 4]


def test_a_step_reports_the_versions_its_trajectories_span_and_the_worst_age():
    one = _traj("t/0", [_turn(4), _turn(4)], launch_version=4)
    split = _traj("t/1", [_turn(3), _turn(3, [(0, 3), (1, 4)])], launch_version=3)
    group = Group("g", target_step=5, group_size=2, prompt_index=0, rows={0: one, 1: split})
    assert trajectory_spans([group]) == {"1": 1, "2": 1}
    s = staleness(5, SampleResult(groups=[group], evicted=[]))
    assert s.trajectory_spans == {"1": 1, "2": 1} and s.multi_version_fraction == 0.5
    assert s.max == 2  # the oldest token (version 3) bounds the group's age at step 5


def test_the_gateway_bounds_a_trajectory_by_its_oldest_token():
    task = make_task("g", env="e", target_step=5, sampling=SamplingParams(max_tokens=8))
    session = Session("s", "train", SamplingParams(max_tokens=8), "g0", "http://x", open_version=4)
    # The first call was admitted under version 1 and interrupted before its first token: its
    # tokens came from versions 2 and 3, so version 1 generated nothing of this trajectory.
    session.turns = [_turn(1, [(0, 2), (2, 3)]), _turn(4)]
    traj = assemble(task, session, Outcome(reward=1.0), None, "gw", 0.0)
    assert traj.launch_version == 2

"""The environment contract (`services.gym_gateway.envs.base.Environment`), passed by every
registered environment.

Every one: the registry builds it from the default config under its own name,
``make_instances`` is deterministic for a seed and JSON-serialisable (or, for NeMo-Gym, a
ValueError naming where its rows come from), and ``aclose`` (the gateway's shutdown) is a
coroutine that closes one that never ran, and may be called again.

Environments whose loop runs in the gateway (crossing, tool_calc, guess_number, echo, and swe's
built-in agent on the local runtime) are played by scripted policies through a real gateway: tasks
on the stream, the worker, the registry's environment, the in-process model client and the session
proxy, in front of a scripted generator (`tests.support.fakes.generator`). A correct policy earns reward
1 and a wrong one 0, each in the number of model calls the task takes, every call recorded; a
policy cut off by ``env.max_turns`` earns 0 within it. A tool call the model writes that does not
parse is answered with an error observation and the episode goes on (the policy, told, still
wins). Drivers that need something outside the gateway (swe's container engine, openhands'
harness interpreter, NeMo-Gym's servers) fail as infrastructure with an error that names it.
"""

from __future__ import annotations

import inspect
import json
import re

import pytest

from services.gym_gateway.envs import ENVIRONMENTS, get_env
from services.gym_gateway.envs.crossing import ACTIONS, RULE
from services.gym_gateway.envs.swe.agent import SHIPPED_INSTANCES
from services.gym_gateway.envs.swe.tools import TOOLS
from shared.openai_api import ChatMessage, ResponseMessage
from shared.protocol import SamplingParams, Task, Trajectory
from shared.sections.gateway import EnvSection
from tests.support.fakes.generator import Policy, call, say, write
from tests.support.gateway import collect
from tests.support.messages import make_task
from tests.support.ports import refused_port

pytestmark = pytest.mark.integration

LOOP_ENVS = ("crossing", "tool_calc", "guess_number", "echo")
DRIVERS = ("swe", "openhands", "nemo_gym")
SEED = 7


def test_every_registered_environment_is_covered_here():
    assert sorted(ENVIRONMENTS) == sorted(LOOP_ENVS + DRIVERS)


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_the_registry_builds_it_from_the_default_config(name):
    env = get_env(name, EnvSection())
    assert env.name == name and isinstance(env, ENVIRONMENTS[name])
    assert type(get_env(name)) is type(env)  # no config: the defaults


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_instances_are_deterministic_for_a_seed_and_json(name):
    env = get_env(name)
    if name == "nemo_gym":
        with pytest.raises(ValueError, match="data.train_path"):
            env.make_instances(4, SEED)
        return
    rows = env.make_instances(6, SEED)
    assert len(rows) == 6 and rows == env.make_instances(6, SEED)
    assert json.loads(json.dumps(rows)) == rows
    assert get_env(name).make_instances(6, SEED) == rows  # a fresh instance draws the same rows


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
async def test_aclose_closes_one_that_never_ran_and_may_be_called_again(name):
    env = get_env(name)
    assert inspect.iscoroutinefunction(env.aclose)
    await env.aclose()
    await env.aclose()


# -- scripted policies -----------------------------------------------------------------------------


def _last(messages: list[ChatMessage], role: str) -> ChatMessage:
    return next(m for m in reversed(messages) if m.role == role)


def crossing(correct: bool) -> Policy:
    def play(messages: list[ChatMessage]) -> ResponseMessage:
        if messages[-1].role == "user":
            return call("look", {})
        light = re.search(r"light is (\w+)", messages[-1].content).group(1)
        return say(RULE[light] if correct else next(a for a in ACTIONS if a != RULE[light]))

    return play


def tool_calc(correct: bool) -> Policy:
    def play(messages: list[ChatMessage]) -> ResponseMessage:
        if messages[-1].role == "user":
            a, op, b = re.search(r"What is (\d+) ([-+*]) (\d+)\?", messages[-1].content).groups()
            return call("calculator", {"expression": f"{a} {op} {b}"})
        result = int(messages[-1].content)
        return say(f"The answer is {result if correct else result + 1}.")

    return play


def guess_number(correct: bool) -> Policy:
    """Bisect on the feedback (always wins 1..7 in 3 guesses); or keep guessing 0."""

    def play(messages: list[ChatMessage]) -> ResponseMessage:
        lo, hi = 1, int(re.search(r"from 1 to (\d+)", messages[0].content).group(1))
        guesses = [json.loads(m.tool_calls[0].function.arguments)["number"] for m in messages if m.role == "assistant"]
        answers = [m.content for m in messages if m.role == "tool"]
        for guess, answer in zip(guesses, answers, strict=True):
            lo, hi = (guess + 1, hi) if answer == "higher" else (lo, guess - 1)
        return call("guess", {"number": (lo + hi) // 2 if correct else 0})

    return play


def echo(correct: bool) -> Policy:
    def play(messages: list[ChatMessage]) -> ResponseMessage:
        words = _last(messages, "user").content.removeprefix("Repeat after me: ")
        return say(words if correct else "nothing like it")

    return play


POLICIES = {"crossing": crossing, "tool_calc": tool_calc, "guess_number": guess_number, "echo": echo}


def bisect_guesses(secret: int, high: int) -> int:
    lo, hi, n = 1, high, 0
    while True:
        n += 1
        guess = (lo + hi) // 2
        if guess == secret:
            return n
        lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)


def calls_to_win(name: str, instance: dict) -> int:
    """Model calls a correct policy makes on ``instance``."""
    return {"crossing": 2, "tool_calc": 2, "echo": 1}.get(name) or bisect_guesses(instance["secret"], instance["high"])


def _task(name: str, group: str, i: int, instance: dict) -> Task:
    return make_task(
        f"{group}-{i}", prompt_index=i, env=name, instance=instance, sampling=SamplingParams(max_tokens=16)
    )


async def _run(stack, tasks: list[Task]) -> dict[str, Trajectory]:
    await stack.streams.publish_many(stack.streams.keys.tasks, tasks)
    trajs = await collect(stack.streams, len(tasks), timeout_s=120)
    assert len(trajs) == len(tasks)
    return {t.task_id: t for t in trajs}


@pytest.mark.parametrize("name", LOOP_ENVS)
async def test_a_correct_policy_earns_1_and_a_wrong_one_0(name, scripted_gateway):
    instances = get_env(name).make_instances(6, SEED)
    policies = {"correct": POLICIES[name](True), "wrong": POLICIES[name](False)}
    tasks = [_task(name, group, i, inst) for group in policies for i, inst in enumerate(instances)]
    async with scripted_gateway(policies, env={"max_turns": 4}) as st:
        trajs = await _run(st, tasks)
    for i, inst in enumerate(instances):
        right, wrong = trajs[f"correct-{i}/0"], trajs[f"wrong-{i}/0"]
        assert (right.status, right.reward) == ("ok", 1.0), (inst, right.fallback_reason)
        assert len(right.turns) == right.metrics["turns"] == calls_to_win(name, inst)
        assert wrong.reward == 0.0 and wrong.status == "ok", (inst, wrong.fallback_reason)
        expected_wrong = inst["budget"] if name == "guess_number" else calls_to_win(name, inst)
        assert len(wrong.turns) == wrong.metrics["turns"] == expected_wrong
        for t in (right, wrong):  # every call recorded, each continuing the one before
            assert t.metrics["model_calls"] == len(t.turns) and t.metrics["prefix_breaks"] == 0.0


@pytest.mark.parametrize("name", ("crossing", "tool_calc", "guess_number"))
async def test_a_policy_cut_off_by_max_turns_earns_0_within_them(name, scripted_gateway):
    instances = [i for i in get_env(name).make_instances(8, SEED) if calls_to_win(name, i) > 1]
    async with scripted_gateway({"correct": POLICIES[name](True)}, env={"max_turns": 1}) as st:
        trajs = await _run(st, [_task(name, "correct", i, inst) for i, inst in enumerate(instances)])
    assert instances and len(trajs) == len(instances)
    for t in trajs.values():
        assert t.reward == 0.0 and len(t.turns) == 1 and t.metrics["turns"] == 1
        assert t.status == ("ok" if name == "guess_number" else "truncated")


# -- swe's built-in agent ------------------------------------------------------------------------

FIX = {
    "command": "str_replace",
    "path": "calc/ops.py",
    "old_str": "    return a / b",
    "new_str": '    if b == 0:\n        raise ValueError("cannot divide by zero")\n    return a / b',
}


def swe(correct: bool) -> Policy:
    def play(messages: list[ChatMessage]) -> ResponseMessage:
        assert messages[0].content.startswith("You are a software engineer")
        if not correct:
            return say("I cannot fix this.")
        if not any(m.role == "assistant" for m in messages):
            return call("str_replace_editor", FIX)
        assert "Edited" in _last(messages, "tool").content
        return call("finish", {})

    return play


async def test_swe_agent_scripted_fix_earns_1_and_no_change_0(scripted_gateway):
    assert {t["function"]["name"] for t in TOOLS} >= {"str_replace_editor", "finish"}
    row = {"instance_id": "calc-divide-by-zero"}
    assert (SHIPPED_INSTANCES / row["instance_id"]).is_dir()
    policies = {"correct": swe(True), "wrong": swe(False)}
    async with scripted_gateway(policies, env={"max_turns": 4}) as st:
        trajs = await _run(st, [_task("swe", group, 0, row) for group in policies])
    right, wrong = trajs["correct-0/0"], trajs["wrong-0/0"]
    assert (right.status, right.reward, len(right.turns)) == ("ok", 1.0, 2), right.fallback_reason
    assert right.metrics["tests_matched"] == right.metrics["tests_expected"] == 3.0
    assert (wrong.status, wrong.reward, len(wrong.turns)) == ("ok", 0.0, 1), wrong.fallback_reason


# -- a tool call that does not parse ----------------------------------------------------------------

UNCLOSED = '<tool_call>\n{"name": "look", "arguments": {'


def told_then(policy: Policy) -> Policy:
    """Writes an unclosed tool call first; once the environment answered it with an error, plays
    ``policy`` on the conversation without the bad turn and its answer."""

    def play(messages: list[ChatMessage]) -> ResponseMessage:
        if not any(m.role == "assistant" for m in messages):
            return write(UNCLOSED)
        bad = next(i for i, m in enumerate(messages) if m.role == "assistant")
        told = messages[bad + 1]
        assert messages[bad].content == UNCLOSED and told.role == "user", messages
        assert told.content.startswith("error: <tool_call> has no closing </tool_call>"), told.content
        return policy(messages[:bad] + messages[bad + 2 :])

    return play


@pytest.mark.parametrize("name", ("crossing", "tool_calc", "guess_number", "swe"))
async def test_a_tool_call_that_does_not_parse_is_answered_with_an_error_and_the_episode_goes_on(
    name, scripted_gateway
):
    if name == "swe":
        instances, play = [{"instance_id": "calc-divide-by-zero"}], swe(True)
    else:  # guess_number: a number the bisection finds with a guess to spare
        instances = [i for i in get_env(name).make_instances(8, SEED) if calls_to_win(name, i) < i.get("budget", 9)]
        play = POLICIES[name](True)
    async with scripted_gateway({"told": told_then(play)}, env={"max_turns": 4}) as st:
        trajs = await _run(st, [_task(name, "told", i, inst) for i, inst in enumerate(instances)])
    assert instances and len(trajs) == len(instances)
    for i, inst in enumerate(instances):
        t = trajs[f"told-{i}/0"]
        assert (t.status, t.reward) == ("ok", 1.0), (inst, t.fallback_reason)
        win = 2 if name == "swe" else calls_to_win(name, inst)
        assert len(t.turns) == t.metrics["model_calls"] == 1 + win and t.metrics["prefix_breaks"] == 0.0
        assert t.metrics["tool_call_errors.unclosed_tag"] == 1.0


# -- drivers without what they need --------------------------------------------------------------


async def test_drivers_fail_as_infrastructure_naming_what_is_missing(scripted_gateway, tmp_path, monkeypatch):
    with refused_port() as port:
        dead = f"http://127.0.0.1:{port}"
        (tmp_path / "empty").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no container engine to be found
        env = {
            "swe": {"runtime": "docker", "git_init_workspace": False},
            "openhands": {"python": str(tmp_path / "no-venv" / "bin" / "python")},
            "nemo_gym": {"head_server_url": dead, "connect_timeout_s": 2.0},
        }
        rows = {
            "swe": {"instance_id": "calc-divide-by-zero"},
            "openhands": {"prompt": "Create answer.txt", "check": "test -f answer.txt"},
            "nemo_gym": {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "some_agent"}},
        }
        async with scripted_gateway({"wrong": swe(False)}, env=env) as st:
            trajs = await _run(st, [_task(name, "wrong", i, rows[name]) for i, name in enumerate(DRIVERS)])
    by_env = {t.env: t for t in trajs.values()}
    reasons = {name: by_env[name].fallback_reason for name in DRIVERS}
    assert all(by_env[name].status == "failed" and by_env[name].failure_kind == "infra" for name in DRIVERS), reasons
    assert reasons["swe"].startswith("sandbox:") and "no 'docker' executable on PATH" in reasons["swe"]
    assert reasons["openhands"].startswith("sandbox:") and "env.openhands.python" in reasons["openhands"]
    assert reasons["nemo_gym"].startswith("nemo_gym_head:") and dead in reasons["nemo_gym"]

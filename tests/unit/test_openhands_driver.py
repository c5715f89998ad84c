"""The OpenHands driver's plumbing without the SDK: the runner's job, the result -> outcome/error
mapping, workspace set-up, the check command, and the runner process's group being killed at the
agent time limit and on cancellation (with a stand-in runner executable, real processes), and a
warm runner (``env.openhands.warm_runners``) that cannot start."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path

import pytest

from services.gym_gateway.envs import get_env, openhands_runner
from services.gym_gateway.envs.base import ChatClient, ModelRequestError, SandboxError, TransportError
from services.gym_gateway.envs.openhands import (
    OFFLINE_ENV,
    AgentRun,
    OpenHandsEnv,
    parse_result,
    prepare_workspace,
    run_check,
    runner_env,
)
from shared.protocol import SamplingParams
from shared.sections.env_openhands import OpenHandsSection
from shared.sections.gateway import EnvSection
from tests.support.pids import gone, text_of

pytestmark = pytest.mark.unit


SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64)


def _client(sampling: SamplingParams | None = SAMPLING) -> ChatClient:
    return ChatClient(
        "http://127.0.0.1:1/sessions/s-1/v1", http=None, timeout_s=30, sampling=sampling, session_id="s-1"
    )


def test_job_carries_session_url_sampling_and_settings(tmp_path):
    env = OpenHandsEnv(OpenHandsSection(tools=["terminal"], terminal_type="subprocess", num_retries=0))
    job = env.job("fix it", tmp_path, _client(), max_turns=5)
    assert job["base_url"] == "http://127.0.0.1:1/sessions/s-1/v1"
    assert job["sampling"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64}
    assert job["max_iterations"] == 5  # env.max_turns when env.openhands.max_iterations is null
    assert job["tools"] == ["terminal"] and job["terminal_type"] == "subprocess" and job["num_retries"] == 0
    assert job["workspace"] == str(tmp_path) and job["prompt"] == "fix it"
    assert (
        OpenHandsEnv(OpenHandsSection(max_iterations=2)).job("x", tmp_path, _client(), max_turns=5)["max_iterations"]
        == 2
    )
    json.dumps(job)  # the runner reads it as JSON
    with pytest.raises(ValueError, match="sampling"):
        env.job("x", tmp_path, _client(None), max_turns=1)


def test_registry_builds_it_from_the_env_section():
    section = EnvSection(openhands=OpenHandsSection(python="/opt/oh/bin/python", max_iterations=4))
    env = get_env("openhands", section)
    assert isinstance(env, OpenHandsEnv) and env.cfg.max_iterations == 4
    assert env.python == Path("/opt/oh/bin/python")
    assert OpenHandsEnv().python.is_absolute()  # relative paths resolve against the source root


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("model_refused", ModelRequestError),
        ("transport", TransportError),
        ("setup_error", SandboxError),
        ("agent_error", SandboxError),
    ],
)
def test_runner_errors_map_to_the_gateways_failure_classes(tmp_path, kind, error):
    result = {"status": "error", "iterations": 1, "actions": {}, "error_kind": kind, "error": "boom 400"}
    with pytest.raises(error, match="boom 400"):
        parse_result(result, 0, tmp_path / "log")


def test_a_crashed_or_silent_runner_is_a_sandbox_error_with_its_log(tmp_path):
    log = tmp_path / "runner.log"
    log.write_text("Traceback ...\nImportError: no openhands\n")
    with pytest.raises(SandboxError, match="(?s)exited with 1 and no result.*no openhands"):
        parse_result({}, 1, log)
    with pytest.raises(SandboxError, match="exited with 0 and no result"):
        parse_result({}, 0, log)
    with pytest.raises(SandboxError, match="malformed"):
        parse_result({"status": "finished", "error_kind": None}, 0, log)


def test_outcome_from_the_agent_run():
    env = OpenHandsEnv(OpenHandsSection(mask_truncated=True))
    done = parse_result(
        {
            "status": "finished",
            "iterations": 3,
            "actions": {"terminal": 2, "finish": 1},
            "error_kind": None,
            "error": None,
        },
        0,
        Path("unused"),
    )
    out = env.outcome(done, 1.0, {"check_exit": 0.0})
    assert (out.reward, out.status, out.mask_sample) == (1.0, "ok", False)
    assert (
        out.metrics["iterations"] == 3.0 and out.metrics["tool_calls"] == 3.0 and out.metrics["agent_finished"] == 1.0
    )
    capped = env.outcome(AgentRun(status="error", iterations=8, actions={}), 0.0, {})
    assert (capped.status, capped.mask_sample, capped.metrics["agent_finished"]) == ("truncated", True, 0.0)
    late = OpenHandsEnv().outcome(AgentRun(status="timeout", iterations=0, actions={}, timed_out=True), 1.0, {})
    assert (late.status, late.reward, late.mask_sample, late.metrics["agent_timed_out"]) == (
        "truncated",
        1.0,
        False,
        1.0,
    )


def test_workspace_from_template_and_files(tmp_path):
    template = tmp_path / "template"
    (template / "pkg").mkdir(parents=True)
    (template / "pkg" / "mod.py").write_text("x = 1\n")
    ws = tmp_path / "ws"
    prepare_workspace(ws, {"template_dir": str(template), "files": {"pkg/mod.py": "x = 2\n", "a/b.txt": "hi"}})
    assert (ws / "pkg" / "mod.py").read_text() == "x = 2\n" and (ws / "a" / "b.txt").read_text() == "hi"
    for bad in ({"../escape": "x"}, {"/etc/passwd": "x"}, {"ok.txt": 3}):
        with pytest.raises(ValueError, match="files"):
            prepare_workspace(tmp_path / "ws2", {"files": bad})
    with pytest.raises(ValueError, match="template_dir"):
        prepare_workspace(tmp_path / "ws3", {"template_dir": str(tmp_path / "missing")})


async def test_check_command_decides_the_reward(tmp_path):
    (tmp_path / "answer.txt").write_text("5\n")
    assert await run_check('test "$(cat answer.txt)" = 5', tmp_path, 10) == (True, 0)
    assert await run_check('test "$(cat answer.txt)" = 6', tmp_path, 10) == (False, 1)
    assert await run_check("sleep 30", tmp_path, 0.5) == (False, -1)


async def test_a_task_without_prompt_or_check_is_a_clear_error():
    with pytest.raises(ValueError, match="'check'"):
        await OpenHandsEnv().rollout({"prompt": "do it"}, _client(), max_turns=1)


def test_runner_environment_is_offline_and_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://secret@host/0")
    monkeypatch.setenv("LMNR_PROJECT_API_KEY", "k")
    env = runner_env(tmp_path / "home", tmp_path / "tmux")
    assert "REDIS_URL" not in env and "LMNR_PROJECT_API_KEY" not in env
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and OFFLINE_ENV.items() <= env.items()
    assert env["HOME"] == str(tmp_path / "home") and env["TMUX_TMPDIR"] == str(tmp_path / "tmux")


class _Named(Exception):
    """An exception shaped like LiteLLM's: its class name and ``status_code`` are what matter."""

    def __init__(self, name: str, status_code: int | None = None) -> None:
        super().__init__(name)
        self.status_code = status_code


def _exc(name: str, status_code: int | None = None) -> Exception:
    return type(name, (_Named,), {})(name, status_code)


def test_runner_classifies_model_failures_through_wrappers():
    classify = openhands_runner.classify
    assert classify(_exc("BadRequestError", 400)) == "model_refused"
    assert classify(_exc("APIConnectionError")) == "transport"
    assert classify(_exc("InternalServerError", 502)) == "transport"
    assert classify(ValueError("tool blew up")) == "agent_error"
    wrapper = _exc("ConversationRunError")
    wrapper.original_exception = _exc("LLMBadRequestError")
    assert classify(wrapper) == "model_refused"
    try:
        try:
            raise _exc("Timeout")
        except Exception as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert classify(outer) == "transport"


def _fake_runner(tmp_path: Path, body: str) -> Path:
    """An executable standing in for the venv's Python: ``$1`` is the runner script, ``$2`` the job
    and ``$3`` the result path, as the driver passes them."""
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/bash\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


async def test_agent_time_limit_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    exe = _fake_runner(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait")
    env = OpenHandsEnv(OpenHandsSection(python=str(exe), timeout_s=1.0))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    run = await env.run_agent("x", tmp_path, _client(), max_turns=1, job_dir=job_dir)
    assert run.timed_out and run.status == "timeout"
    child = int(pidfile.read_text())
    assert await gone(child)


async def test_cancelling_the_rollout_kills_the_runner_and_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    exe = _fake_runner(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait")
    env = OpenHandsEnv(OpenHandsSection(python=str(exe)))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    task = asyncio.create_task(env.run_agent("x", tmp_path, _client(), max_turns=1, job_dir=job_dir))
    child = int(await text_of(pidfile))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gone(child)


async def test_the_runner_gets_the_job_and_its_result_is_read(tmp_path):
    # The stand-in copies the job's sampling into a result, as the real runner reports a run.
    script = tmp_path / "echo_job.py"
    script.write_text(
        "import json, sys\njob = json.load(open(sys.argv[2]))\n"
        "json.dump({'status': 'finished', 'iterations': job['sampling']['max_tokens'], 'actions': {'finish': 1},"
        " 'error_kind': None, 'error': None}, open(sys.argv[3], 'w'))\n"
    )
    exe = _fake_runner(tmp_path, f'exec {sys.executable} {script} "$@"')
    env = OpenHandsEnv(OpenHandsSection(python=str(exe)))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    run = await env.run_agent("x", tmp_path, _client(), max_turns=1, job_dir=job_dir)
    assert run == AgentRun(status="finished", iterations=64, actions={"finish": 1})


async def test_a_missing_interpreter_is_a_sandbox_error_naming_the_key(tmp_path):
    env = OpenHandsEnv(OpenHandsSection(python=str(tmp_path / "nope" / "python")))
    with pytest.raises(SandboxError, match="env.openhands.python"):
        await env.rollout({"prompt": "p", "check": "true"}, _client(), max_turns=1)


SHIPPED_SWE = Path(__file__).resolve().parents[2] / "data" / "swe_instances"


@pytest.mark.parametrize("fix", [True, False])
async def test_swe_instance_is_scored_by_its_hidden_tests(tmp_path, fix):
    """A stand-in agent applies the instance's gold patch (or nothing) in the workspace it is
    started in; the reward is what the SWE driver's hidden tests say about that workspace."""
    gold = json.loads((SHIPPED_SWE / "calc-divide-by-zero" / "instance.json").read_text())["gold_patch"]
    patch = tmp_path / "gold.diff"
    patch.write_text(gold)
    prompt_file = tmp_path / "prompt.txt"
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, subprocess, sys\njob = json.load(open(sys.argv[2]))\n"
        f"open({str(prompt_file)!r}, 'w').write(job['prompt'])\n"
        + (f"subprocess.run(['git', 'apply', {str(patch)!r}], check=True)\n" if fix else "")
        + "json.dump({'status': 'finished', 'iterations': 1, 'actions': {}, 'error_kind': None, 'error': None},"
        " open(sys.argv[3], 'w'))\n"
    )
    exe = _fake_runner(tmp_path, f'exec {sys.executable} {script} "$@"')
    env = OpenHandsEnv(OpenHandsSection(python=str(exe)))
    out = await env.rollout({"swe": {"instance_id": "calc-divide-by-zero"}}, _client(), max_turns=1)
    assert out.reward == (1.0 if fix else 0.0) and out.status == "ok"
    assert out.metrics["tests_expected"] == 3.0 and out.metrics["tests_matched"] == (3.0 if fix else 2.0)
    assert "cannot divide by zero" in prompt_file.read_text() and str(tmp_path) not in prompt_file.read_text()


@pytest.mark.parametrize(
    ("python", "message"),
    [
        ("nope/python", "env.openhands.python"),  # no interpreter at all
        (sys.executable, "No module named 'openhands'"),  # one without the SDK: the runner's log says so
    ],
)
async def test_a_warm_runner_that_cannot_start_is_a_sandbox_error(tmp_path, python, message):
    env = OpenHandsEnv(OpenHandsSection(python=str(tmp_path / python), warm_runners=1))
    try:
        with pytest.raises(SandboxError, match=message):
            await env.rollout({"prompt": "p", "check": "true"}, _client(), max_turns=1)
    finally:
        await env.aclose()

"""SWE driver with the local runtime and real pytest runs: the reward of gold and untouched
repositories, the agent's copy (no original history, no hidden tests), attempts to game the reward
(editing the hidden tests, fake test files, conftest hooks, a planted pytest), deletions and new
files reaching the reward run, R2E-Gym and SWE-bench rows, and the command runner (process-group
kill at the deadline, scrubbed environment, output cap)."""

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from services.gym_gateway.envs.swe import apply_patch, evaluate, load_instances, make_runtime
from services.gym_gateway.envs.swe.agent import SHIPPED_INSTANCES
from shared.sections.env_swe import SweSection

pytestmark = pytest.mark.integration

ROWS = Path(__file__).resolve().parents[1] / "data" / "swe"
INSTANCES = {i.instance_id: i for i in load_instances(SHIPPED_INSTANCES)}
CALC = INSTANCES["calc-divide-by-zero"]
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
    "PATH": os.environ["PATH"],
    "HOME": "/tmp",
}

PASS_EVERYTHING = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
"""
FAKE_PYTEST = """
import sys
print("=== short test summary info ===")
for name in ("test_divide_exact", "test_divide_fraction", "test_divide_by_zero_raises_value_error"):
    print(f"PASSED hidden_tests/test_divide.py::{name}")
sys.exit(0)
"""


@pytest.fixture
def runtime():
    return make_runtime(SweSection(command_timeout_s=30, eval_timeout_s=60))


@pytest.mark.parametrize("instance_id", sorted(INSTANCES))
async def test_gold_patch_earns_the_reward_and_the_untouched_repo_does_not(runtime, instance_id):
    inst = INSTANCES[instance_id]
    async with runtime.workspace(inst) as ws:
        untouched = await evaluate(inst, ws)
        apply_patch(ws.path, inst.gold_patch)
        gold = await evaluate(inst, ws)
    assert untouched.reward == 0.0 and untouched.mismatched and untouched.statuses
    assert gold.reward == 1.0 and gold.statuses == inst.expected
    assert gold.metrics["tests_matched"] == gold.metrics["tests_expected"] == len(inst.expected)


async def test_workspace_has_neither_the_history_nor_the_hidden_tests(runtime, tmp_path):
    snap = tmp_path / "snapshot"
    shutil.copytree(CALC.repo_dir, snap)
    # history that holds the fix (a later commit, then reverted), and a stale copy of the hidden tests
    subprocess.run("git init -q && git add -A && git commit -qm base", shell=True, cwd=snap, env=GIT_ENV, check=True)
    apply_patch(snap, CALC.gold_patch)
    subprocess.run(
        "git commit -qam fix && git revert --no-edit HEAD >/dev/null", shell=True, cwd=snap, env=GIT_ENV, check=True
    )
    fix_commit = subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=snap, capture_output=True, text=True).stdout.strip()
    shutil.copytree(CALC.hidden_tests_dir, snap / "hidden_tests")
    inst = msgspec.structs.replace(CALC, repo_dir=str(snap))
    async with runtime.workspace(inst) as ws:
        log = await ws.run("git log --format=%s --all; git cat-file -t " + fix_commit)
        names = {p.name for p in ws.path.rglob("*")}
        result = await evaluate(inst, ws)
    assert log.output.splitlines()[0] == "Initial snapshot" and "fix" not in log.output
    assert "fatal" in log.output  # the fix commit is unknown in the agent's repository
    assert "test_divide.py" not in names and "hidden_tests" not in names
    assert result.reward == 0.0


async def test_without_git_init_the_workspace_has_no_git_at_all(tmp_path):
    runtime = make_runtime(SweSection(git_init_workspace=False))
    async with runtime.workspace(CALC) as ws:
        assert not (ws.path / ".git").exists() and (ws.path / "calc" / "ops.py").exists()


async def _write(ws, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (ws.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws.path / rel).write_text(text)


HACKS = {
    "rewrite the hidden tests in place": {
        "hidden_tests/test_divide.py": (
            "def test_divide_exact(): pass\ndef test_divide_fraction(): pass\n"
            "def test_divide_by_zero_raises_value_error(): pass\n"
        )
    },
    "a conftest that passes every test": {"conftest.py": PASS_EVERYTHING},
    "a conftest beside the hidden tests": {"hidden_tests/conftest.py": PASS_EVERYTHING},
    "a planted pytest module": {"pytest.py": FAKE_PYTEST},
    "a fake test file": {"tests/test_fake.py": "def test_divide_by_zero_raises_value_error(): pass\n"},
}


@pytest.mark.parametrize("hack", sorted(HACKS))
async def test_gaming_the_tests_earns_nothing(runtime, hack):
    async with runtime.workspace(CALC) as ws:
        await _write(ws, HACKS[hack])
        result = await evaluate(CALC, ws)
        apply_patch(ws.path, CALC.gold_patch)
        with_fix = await evaluate(CALC, ws)  # the hack does not spoil an honest fix either
    assert result.reward == 0.0, result.log_tail
    assert with_fix.reward == 1.0, with_fix.log_tail


async def test_the_conftest_hack_works_when_nothing_is_protected():
    """The protection, not the hack's failure, is what keeps the reward at 0 above."""
    runtime = make_runtime(SweSection(protected_paths=[]))
    async with runtime.workspace(CALC) as ws:
        await _write(ws, {"conftest.py": PASS_EVERYTHING})
        result = await evaluate(CALC, ws)
    assert result.reward == 1.0


async def test_new_files_and_deletions_reach_the_reward_run(runtime):
    inst = INSTANCES["calc-divide-by-zero"]
    async with runtime.workspace(inst) as ws:
        await _write(
            ws,
            {
                "calc/guards.py": (
                    "def nonzero(b):\n    if b == 0:\n        raise ValueError('cannot divide by zero')\n    return b\n"
                )
            },
        )
        ops = (ws.path / "calc" / "ops.py").read_text()
        (ws.path / "calc" / "ops.py").write_text(
            "from calc.guards import nonzero\n" + ops.replace("return a / b", "return a / nonzero(b)")
        )
        fixed = await evaluate(inst, ws)
        (ws.path / "calc" / "guards.py").unlink()
        broken = await evaluate(inst, ws)
    assert fixed.reward == 1.0
    assert broken.reward == 0.0 and "No module named 'calc.guards'" in broken.log_tail


async def test_r2e_row_rewards_by_r2e_keys(runtime):
    [inst] = load_instances(ROWS / "r2e_row.json")
    async with runtime.workspace(inst) as ws:
        untouched = await evaluate(inst, ws)
        apply_patch(ws.path, INSTANCES["stack-peek-empty"].gold_patch)
        gold = await evaluate(inst, ws)
    assert untouched.reward == 0.0 and untouched.statuses["TestStack.test_peek_empty_raises"] == "FAILED"
    assert gold.reward == 1.0 and gold.statuses == inst.expected


async def test_swebench_row_applies_its_test_patch_to_the_reward_copy(runtime):
    [inst] = load_instances(ROWS / "swebench_row.json")
    async with runtime.workspace(inst) as ws:
        assert "test_collapses_runs_of_separators" not in (ws.path / "tests" / "test_slug.py").read_text()
        untouched = await evaluate(inst, ws)
        # Emptying the test file the patch targets does not help: the snapshot's copy is patched.
        (ws.path / "tests" / "test_slug.py").write_text("")
        emptied = await evaluate(inst, ws)
        apply_patch(ws.path, inst.gold_patch)
        gold = await evaluate(inst, ws)
    assert untouched.reward == 0.0 and untouched.statuses["tests/test_slug.py::test_single_word"] == "PASSED"
    assert emptied.reward == 0.0
    assert gold.reward == 1.0 and gold.mismatched == []


async def test_a_hanging_test_run_is_cut_and_earns_nothing():
    runtime = make_runtime(SweSection(eval_timeout_s=3))
    inst = INSTANCES["inventory-total"]
    async with runtime.workspace(inst) as ws:
        apply_patch(ws.path, inst.gold_patch)
        src = (ws.path / "shop" / "inventory.py").read_text()
        (ws.path / "shop" / "inventory.py").write_text(
            src.replace('"""The value', 'while True: pass\n        """The value')
        )
        result = await evaluate(inst, ws)
    assert result.reward == 0.0 and result.timed_out and result.metrics["eval_timeout"] == 1.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _dies(pid: int, within_s: float = 5.0) -> bool:
    """SIGKILL is delivered asynchronously: give the process a moment to be gone."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def test_deadline_kills_the_whole_process_group(runtime):
    async with runtime.workspace(CALC) as ws:
        res = await ws.run("sleep 300 & echo $! > bg.pid; sleep 300", timeout_s=1.0)
        bg = int((ws.path / "bg.pid").read_text())
        assert res.timed_out and res.exit_code is None and "ran past its 1s limit" in res.output
        # Returned at its deadline, not once the sleeps holding its output open end (300 s): the
        # bound is the requirement, with room for a loaded machine.
        assert res.duration_s < 60
        assert _dies(bg)
        # a command that returns at once may not leave anything running either
        quick = await ws.run("sleep 300 & echo $! > bg2.pid; echo started", timeout_s=20.0)
        # Ended with its shell, not held open by the background sleep until its 20 s limit.
        assert not quick.timed_out and quick.exit_code == 0 and quick.output.strip() == "started"
        assert _dies(int((ws.path / "bg2.pid").read_text()))


async def test_a_cancelled_command_takes_its_process_group_with_it(runtime):
    """The worker cancels a rollout at its deadline: nothing the agent started may live on."""
    async with runtime.workspace(CALC) as ws:
        task = asyncio.create_task(ws.run("sleep 300 & echo $! > bg.pid; sleep 300"))
        while not (ws.path / "bg.pid").exists() or not (ws.path / "bg.pid").read_text().strip():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _dies(int((ws.path / "bg.pid").read_text()))


async def test_commands_get_a_scrubbed_environment_in_the_workspace(runtime, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://:secret@db:6379")
    monkeypatch.setenv("STREAMRL_API_TOKEN", "secret-token")
    async with runtime.workspace(CALC) as ws:
        res = await ws.run("pwd; env; exit 3")
    assert res.exit_code == 3 and "secret" not in res.output
    lines = res.output.splitlines()
    assert lines[0] == str(ws.path)
    assert f"HOME={ws.home}" in lines and "PYTHONDONTWRITEBYTECODE=1" in lines


async def test_output_is_cut_to_its_head_and_tail():
    runtime = make_runtime(SweSection(max_output_chars=1000))
    async with runtime.workspace(CALC) as ws:
        res = await ws.run("echo BEGIN; head -c 200000 /dev/zero | tr '\\0' x; echo; echo END")
    assert res.output.startswith("BEGIN") and res.output.rstrip().endswith("END")
    assert "bytes of output cut" in res.output and len(res.output) < 1100

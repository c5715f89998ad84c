"""scripts/test.sh (the README's test command): set-up (the harnesses' virtualenvs and kubectl in the
background while the gates run), the ruff and mypy gates, then pytest on three workers; a failing gate
or set-up stops it before pytest. Run against stand-ins for the set-up scripts and tools, which
record their calls."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GATES = [
    "ruff check services shared shared_torch streamrl tests scripts",
    "ruff format --check services shared shared_torch streamrl tests scripts",
    "mypy",
]


def _tree(tmp_path: Path, failing: str | None = None) -> Path:
    """A copy of scripts/test.sh beside stand-ins that log ``<name> <args>`` to calls.log;
    ``failing`` exits 1."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    log = tmp_path / "calls.log"
    stubs = {f"scripts/{s}.sh": s for s in ("setup", "k8s_tools", "setup_slurm", "setup_openhands", "setup_nemo_gym")}
    stubs.update({f".venv/bin/{t}": t for t in ("ruff", "mypy", "python")})
    for rel, name in stubs.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        code = 1 if name == failing else 0
        path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\nexit {code}\n')
        path.chmod(0o755)
    return tmp_path


def _run(tree: Path, *args: str, **env: str) -> tuple[int, list[str]]:
    proc = subprocess.run(
        ["bash", str(tree / "scripts" / "test.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    log = tree / "calls.log"
    return proc.returncode, [line.rstrip() for line in log.read_text().splitlines()] if log.exists() else []


BACKGROUND = {"k8s_tools", "setup_slurm", "setup_openhands", "setup_nemo_gym"}  # set up while the gates run
XDIST = "-n 3 --dist loadfile --no-loadscope-reorder"


def test_set_up_then_the_gates_then_pytest_on_three_workers_with_the_arguments(tmp_path):
    code, calls = _run(_tree(tmp_path), "-m", "unit", STREAMRL_TEST_WORKERS="")
    assert code == 0
    assert calls[0] == "setup" and set(calls[1:-1]) == BACKGROUND | set(GATES)
    assert [c for c in calls if c in GATES] == GATES  # in this order
    assert calls[-1] == f"python -m pytest {XDIST} -m unit"


def test_no_workers_runs_pytest_in_its_own_process(tmp_path):
    code, calls = _run(_tree(tmp_path), "-x", STREAMRL_TEST_WORKERS="0")
    assert code == 0 and calls[-1] == "python -m pytest -x"


@pytest.mark.parametrize("failing", ["ruff", "mypy", "setup_nemo_gym"])
def test_a_failing_gate_or_set_up_fails_the_command_before_pytest(tmp_path, failing):
    code, calls = _run(_tree(tmp_path, failing=failing))
    assert code != 0
    assert not any(c.startswith("python") for c in calls)

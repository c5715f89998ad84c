"""scripts/test.sh (the README's test command): set-up, then the ruff and mypy gates, then pytest;
a failing gate stops it before pytest. Run against stand-ins for the set-up scripts and tools, which
record their calls."""

from __future__ import annotations

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
    stubs = {f"scripts/{s}.sh": s for s in ("setup", "k8s_tools", "setup_openhands", "setup_nemo_gym")}
    stubs.update({f".venv/bin/{t}": t for t in ("ruff", "mypy", "python")})
    for rel, name in stubs.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        code = 1 if name == failing else 0
        path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\nexit {code}\n')
        path.chmod(0o755)
    return tmp_path


def _run(tree: Path, *args: str) -> tuple[int, list[str]]:
    proc = subprocess.run(["bash", str(tree / "scripts" / "test.sh"), *args], capture_output=True, text=True)
    log = tree / "calls.log"
    return proc.returncode, [line.rstrip() for line in log.read_text().splitlines()] if log.exists() else []


def test_set_up_then_the_gates_then_pytest_with_the_arguments(tmp_path):
    code, calls = _run(_tree(tmp_path), "-m", "unit")
    assert code == 0
    assert calls == [
        "setup",
        "k8s_tools",
        "setup_openhands",
        "setup_nemo_gym",
        *GATES,
        "python -m pytest -m unit",
    ]


@pytest.mark.parametrize("failing", ["ruff", "mypy"])
def test_a_failing_gate_fails_the_command_before_pytest(tmp_path, failing):
    code, calls = _run(_tree(tmp_path, failing=failing))
    assert code != 0
    assert not any(c.startswith("python") for c in calls)

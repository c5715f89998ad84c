"""The top-level Makefile: each target runs the command it promises (checked with ``make -n``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")]

ROOT = Path(__file__).resolve().parents[2]


def dry_run(*args: str) -> list[str]:
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line.rstrip() for line in out.splitlines()]


def test_test_is_the_readmes_test_script_with_arguments_passed_through():
    assert dry_run("test", "ARGS=-m unit") == ["bash scripts/test.sh -m unit"]


def test_bench_sets_up_then_runs_every_benchmark():
    assert dry_run("bench") == ["bash scripts/setup.sh", ".venv/bin/python -m streamrl.cli bench"]
    assert dry_run("bench", "ARGS=--only generator")[-1].endswith("bench --only generator")


def test_soak_selects_the_soak_tests_with_the_long_variant_enabled():
    assert dry_run("soak")[-1] == "STREAMRL_LONG_TESTS=1 .venv/bin/python -m pytest -m soak tests/soak"


def test_fuzz_raises_the_examples_per_operation():
    assert dry_run("fuzz", "STREAMRL_FUZZ_EXAMPLES=50")[-1] == (
        "STREAMRL_FUZZ_EXAMPLES=50 .venv/bin/python -m pytest tests/integration/test_fuzz_http.py"
    )

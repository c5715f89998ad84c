"""The generator's command line: argument forms and a light entry point (no heavy imports)."""

import subprocess
import sys

import pytest

from services.generator.__main__ import parse_args

pytestmark = pytest.mark.unit


def test_overrides_may_come_before_or_after_options():
    args = parse_args(
        ["--config", "run.yaml", "policy.generation.backend=transformers", "--port", "0", "--worker-id", "g0"]
    )
    assert (args.config, args.port, args.worker_id) == ("run.yaml", 0, "g0")
    assert args.overrides == ["policy.generation.backend=transformers"]
    assert parse_args(["--config", "run.yaml"]).port is None


def test_entry_point_imports_nothing_heavy():
    code = (
        "import sys, services.generator.__main__; print(sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_config_exits_with_the_key_named(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("generator:\n  no_such_key: 1\n")
    out = subprocess.run(
        [sys.executable, "-m", "services.generator", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "generator.no_such_key" in out.stderr

"""Every service's command line: argument forms, a light entry point (no heavy imports before the
config loaded), and config errors that name the key."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.service_cli import parse_service_args

pytestmark = pytest.mark.unit
SERVICES = ["generator", "gym_gateway", "trainer"]
ROOT = Path(__file__).resolve().parents[2]
# What ``python -m services.<name>`` runs before it imports anything heavy; exit 0 when it accepts
# the config. In a child process: the loader sets up the process-wide logging.
_LOAD_CONFIG = (
    "import sys; from shared.service_cli import load_service_config, parse_service_args; "
    "s = sys.argv[1]; sys.exit(0 if load_service_config(s, parse_service_args(s, '', sys.argv[2:])) else 2)"
)


def test_overrides_may_come_before_or_after_options():
    args = parse_service_args(
        "generator",
        "",
        ["--config", "run.yaml", "policy.generation.backend=transformers", "--port", "0", "--worker-id", "g0"],
    )
    assert (args.config, args.port, args.worker_id) == ("run.yaml", 0, "g0")
    assert args.overrides == ["policy.generation.backend=transformers"]
    assert parse_service_args("trainer", "", ["--config", "run.yaml"]).port is None


@pytest.mark.parametrize("service", SERVICES)
def test_entry_point_imports_nothing_heavy(service):
    code = (
        f"import sys, services.{service}.__main__; "
        "print(sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("service", SERVICES)
def test_bad_config_exits_with_the_key_named(tmp_path, service):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"{service}:\n  no_such_key: 1\n")
    out = subprocess.run(
        [sys.executable, "-m", f"services.{service}", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert f"unknown config key '{service}.no_such_key'" in out.stderr


def test_a_mistyped_override_is_answered_with_the_nearest_key(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("policy: {model_name: m}\n")
    out = subprocess.run(
        [sys.executable, "-m", "services.generator", "--config", str(cfg), "generator.drain_timout_s=5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "unknown config key 'generator.drain_timout_s' (did you mean 'generator.drain_timeout_s'?)" in out.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_requires_only_the_config_it_reads(tmp_path, service):
    """No dataset in the config: only the trainer reads one, so only the trainer refuses it."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("policy: {model_name: m}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_API_TOKEN")}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_CONFIG, service, "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    if service == "trainer":
        assert out.returncode == 2 and "config error: data.train_path is required" in out.stderr
    else:
        assert out.returncode == 0, out.stderr

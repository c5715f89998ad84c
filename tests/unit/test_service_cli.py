"""Every service's command line: argument forms, a light entry point (no heavy imports before the
config loaded), and config errors that name the key."""

import subprocess
import sys

import pytest

from shared.service_cli import parse_service_args

pytestmark = pytest.mark.unit
SERVICES = ["generator", "gym_gateway", "trainer"]


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

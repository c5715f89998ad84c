"""Checks shared by the deployment tests (docker-compose.yml, deploy/k8s): a container's command and
environment are ones the service accepts.

`launch` runs the service's own command-line parser and config loader (`shared.service_cli`, the
code every ``python -m services.<name>`` runs first, including the bind/token check) in a fresh
process with exactly the container's environment and working folder, and reports what it
rejected. `unknown_env` names variables no service reads.
"""

from __future__ import annotations

import atexit
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


# One process answers every engine-worker check of a test session: importing vLLM and the generator
# takes seconds, parsing a command line milliseconds. A request is one JSON line (run config,
# argv after `vllm`, environment); the answer is one JSON line.
_VLLM_PROBE = """
import contextlib, dataclasses, io, json, os, sys, traceback
import msgspec
from services.generator.vllm_env import apply_env_defaults
apply_env_defaults()
# The model folder is on the pod's shared volume, absent here; offline, vLLM would resolve its path
# in the hub's cache while building the arguments. Nothing is downloaded either way (no config read).
os.environ["HF_HUB_OFFLINE"] = "0"
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
from services.generator.vllm_engine import VllmEngine
from shared.run_config import RunConfig

def parse(argv):
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    ns = parser.parse_args(argv)
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    serve.validate(ns)
    return ns

def check(cfg, argv):
    ns = parse(argv)
    worker = AsyncEngineArgs.from_cli_args(ns)
    unset = AsyncEngineArgs.from_cli_args(parse(["serve", ns.model]))
    leader = VllmEngine(msgspec.convert(cfg, RunConfig))._configured_engine_args()
    differ = []
    for f in dataclasses.fields(AsyncEngineArgs):
        mine, theirs = getattr(leader, f.name), getattr(worker, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name != "node_rank" and mine != theirs and not (mine == default and theirs == getattr(unset, f.name)):
            differ.append([f.name, repr(mine), repr(theirs)])
    keys = ("headless", "nnodes", "node_rank", "master_addr", "master_port", "model")
    return {"args": {k: getattr(ns, k) for k in keys}, "differ": differ}

for line in sys.stdin:
    req = json.loads(line)
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in req["env"].items() if k != "HF_HUB_OFFLINE"})
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            answer = check(req["cfg"], req["argv"])
    except SystemExit:
        answer = {"error": err.getvalue().strip().splitlines()[-1:]}
    except Exception:
        answer = {"error": traceback.format_exc().strip().splitlines()[-1:]}
    os.environ.clear()
    os.environ.update(saved)
    print(json.dumps(answer), flush=True)
"""
_VLLM_PROCESS: list[subprocess.Popen] = []


def _ask_vllm(request: dict) -> dict:
    if not _VLLM_PROCESS or _VLLM_PROCESS[0].poll() is not None:
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/")}
        _VLLM_PROCESS[:] = [
            subprocess.Popen(
                [sys.executable, "-c", _VLLM_PROBE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=ROOT,
                env=env,
            )
        ]
        atexit.register(_VLLM_PROCESS[0].kill)
    proc = _VLLM_PROCESS[0]
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    return json.loads(line) if line else {"error": ["the vLLM probe process exited"]}


@dataclass
class EngineWorker:
    """What vLLM made of a `vllm serve --headless` command: a few parsed arguments, and the engine
    arguments that differ from the ones the generator builds from the run config (name, the
    generator's, the worker's)."""

    args: dict[str, Any] = field(default_factory=dict)
    differ: list[tuple[str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


_WORKERS: dict[str, dict] = {}


def engine_worker(argv: list[str], env: dict[str, str], cfg: RunConfig, *, where: str) -> EngineWorker:
    """Parse ``vllm serve ...`` with vLLM's own parser (and its checks of the parsed arguments) and
    compare the engine arguments with those `services.generator.vllm_engine` builds from ``cfg``
    (the configured ones; node_rank aside). Needs vllm."""
    out = EngineWorker()
    if argv[:2] != ["vllm", "serve"]:
        out.problems.append(f"{where}: {argv[:2]} is not `vllm serve`")
        return out
    # The engine's arguments come from these keys only (policy.model_name, tokenizer_name and
    # generation, run.seed, refit): a change elsewhere in the config asks vLLM nothing new.
    tree = msgspec.to_builtins(cfg)
    policy = {k: tree["policy"][k] for k in ("model_name", "tokenizer_name", "generation")}
    request = {"cfg": {"policy": policy, "run": {"seed": cfg.run.seed}, "refit": tree["refit"]}, "argv": argv[1:]}
    request["env"] = env
    key = json.dumps(request, sort_keys=True)
    if key not in _WORKERS:
        _WORKERS[key] = _ask_vllm(request)
    result = _WORKERS[key]
    if "error" in result:
        out.problems.append(f"{where}: vllm serve rejects {argv[2:]}: {' | '.join(result['error'])[:500]}")
        return out
    out.args, out.differ = result["args"], [tuple(d) for d in result["differ"]]
    return out

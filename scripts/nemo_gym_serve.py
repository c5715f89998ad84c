"""Start a NeMo-Gym deployment for the gym gateway: NeMo-Gym's head server and the package's own
resources servers and agents, unchanged, each in its own process; no model server and no Ray.

Run by the NeMo-Gym virtualenv's Python (scripts/setup_nemo_gym.sh), never imported by streamrl:

    .venv-nemo-gym/bin/python scripts/nemo_gym_serve.py --config A.yaml [--config B.yaml ...]

The configs are merged and resolved by NeMo-Gym's own parser, as ``gym env start --config ...``
does (config paths relative to the current folder or to the installed package, ports picked where
a config leaves them out). Then, as ``gym env start`` does, the head server runs in this process
and every resources server and agent is started from its folder with its ``entrypoint``, getting
the resolved config in ``NEMO_GYM_CONFIG_DICT`` and its name in ``NEMO_GYM_CONFIG_PATH``. What
differs from ``gym env start``, and why:

* No model server is started: the gym gateway is the policy model server, so the configs name a
  gateway worker (host, port) under ``responses_api_models`` instead of a model server to launch.
* No Ray cluster: ``gym env start`` always starts one, which binds every network interface. A
  server that does not declare ``ray_enabled = False`` would start its own, so it is refused.
* No per-server virtualenvs (``gym env start`` builds them with uv): every server runs on this
  Python, whose virtualenv has the package and its pinned dependencies.
* Environment servers (``environment_servers``, the relays in front of agents) are not started:
  the driver posts each row to its agent's ``/run``, as NeMo-RL does.

Once every server answers HTTP it prints one line, ``ready <name>=<url> ...``, and serves until
SIGTERM or SIGINT, which stops the servers; if a server exits, it stops the others and exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from nemo_gym import PARENT_DIR
from nemo_gym.global_config import (
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_RESERVED_TOP_LEVEL_KEYS,
    GlobalConfigDictParserConfig,
    get_global_config_dict,
)
from nemo_gym.server_utils import HeadServer
from omegaconf import DictConfig, OmegaConf

STARTED_TYPES = ("resources_servers", "responses_api_agents")
SKIPPED_TYPES = ("responses_api_models", "environment_servers")
POLL_S = 0.5
NO_RAY = re.compile(r"^[ \t]+ray_enabled\b[^=\n]*=\s*False\b", re.MULTILINE)


def servers(config: DictConfig) -> list[tuple[str, str, str, DictConfig]]:
    """(name, server type, implementation, instance config) of every server the config declares:
    ``{name: {<server type>: {<implementation>: {entrypoint, host, port, ...}}}}``."""
    found = []
    for name, by_type in config.items():
        if name in NEMO_GYM_RESERVED_TOP_LEVEL_KEYS or not isinstance(by_type, DictConfig):
            continue
        for server_type, by_impl in by_type.items():
            if not isinstance(by_impl, DictConfig):
                continue
            for impl, inst in by_impl.items():
                if isinstance(inst, DictConfig) and "port" in inst:
                    found.append((str(name), str(server_type), str(impl), inst))
    return found


def server_dir(server_type: str, impl: str) -> Path:
    """The server's folder: in the current folder (a user's own server) or in the installed package."""
    for root in (Path.cwd(), PARENT_DIR):
        if (root / server_type / impl).is_dir():
            return root / server_type / impl
    raise SystemExit(f"no folder {server_type}/{impl} in {Path.cwd()} nor in the nemo-gym package")


def check_no_ray(name: str, folder: Path, entrypoint: str) -> None:
    """Refuse a server that does not declare ``ray_enabled = False``: NeMo-Gym would start a Ray
    cluster of its own in that server's process (read from the source, without importing it)."""
    if not NO_RAY.search((folder / entrypoint).read_text()):
        raise SystemExit(f"{name} ({folder.name}) does not declare ray_enabled = False: it needs Ray, not started here")


def start(name: str, folder: Path, entrypoint: str, config_yaml: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: config_yaml,
        NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: name,
        "PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.Popen([sys.executable, entrypoint], cwd=folder, env=env)


def answers(url: str) -> bool:
    """Whether anything answers HTTP at ``url`` (any status counts, as NeMo-Gym's own poll)."""
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exited(procs: dict[str, subprocess.Popen[bytes]]) -> str | None:
    return next((f"{n} exited with status {p.returncode}" for n, p in procs.items() if p.poll() is not None), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="NeMo-Gym config YAML; repeatable")
    args = parser.parse_args(argv)
    config = get_global_config_dict(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create({"config_paths": args.config}), skip_load_from_cli=True
        )
    )
    config_yaml = OmegaConf.to_yaml(config)
    head = config["head_server"]
    urls = {"head_server": f"http://{head['host']}:{head['port']}"}
    head_uvicorn, _, head_server = HeadServer.run_webserver()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    try:
        for name, server_type, impl, inst in servers(config):
            if server_type in SKIPPED_TYPES:
                continue
            if server_type not in STARTED_TYPES:
                raise SystemExit(f"{name}: server type {server_type} is not supported here")
            folder = server_dir(server_type, impl)
            check_no_ray(name, folder, inst["entrypoint"])
            procs[name] = start(name, folder, inst["entrypoint"], config_yaml)
            urls[name] = f"http://{inst['host']}:{inst['port']}"
        spinup_deadline = time.monotonic() + float(config.get("server_spinup_timeout_seconds", 600))
        waiting = dict(urls)
        while waiting and not stopping:
            if (failed := exited(procs)) is not None:
                raise SystemExit(failed)
            if time.monotonic() > spinup_deadline:
                raise SystemExit(f"not answering after server_spinup_timeout_seconds: {', '.join(waiting)}")
            waiting = {n: u for n, u in waiting.items() if not answers(u)}
            time.sleep(POLL_S if waiting else 0)
        if stopping:
            return 0
        head_server.mark_ready()
        print("ready " + " ".join(f"{n}={u}" for n, u in urls.items()), flush=True)
        while not stopping:
            if (failed := exited(procs)) is not None:
                raise SystemExit(failed)
            time.sleep(POLL_S)
        return 0
    finally:
        stop(procs)
        head_uvicorn.should_exit = True


if __name__ == "__main__":
    sys.exit(main())

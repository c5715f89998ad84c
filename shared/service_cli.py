"""The command line every service shares:
``python -m services.<name> --config RUN.yaml [--port N] [--worker-id ID] [key=value ...]``.

Only argparse and the config loader are imported here, so ``--help`` and config errors are
instant; each service imports its heavy libraries after `load_service_config` succeeded.
"""

from __future__ import annotations

import argparse
import logging
import sys

from shared.auth import check_bind, is_loopback, load_api_token
from shared.config import load
from shared.config_error import ConfigError
from shared.logs import setup_logging
from shared.run_config import RunConfig, ServiceName


def parse_service_args(service: str, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=description)
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--port", type=int, default=None, help=f"port to bind (default: {service}.port; 0: any free port)")
    p.add_argument("--worker-id", default=None, help="registry and consumer name (stable across restarts)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. grpo.max_num_steps=5")
    return p.parse_intermixed_args(argv)


def load_service_config(service: ServiceName, args: argparse.Namespace) -> RunConfig | None:
    """Set up logging, load the run config, check what this service needs of it (only what it
    reads: `RunConfig.check_service`) and that it may bind its address (an open control plane
    only on loopback, see `shared.auth`); on an error print it and return None."""
    setup_logging(service)
    try:
        cfg = load(RunConfig, args.config, args.overrides)
        cfg.check_service(service)
        token = load_api_token()
        host = getattr(cfg, service).host
        check_bind(host, f"{service}.host", token, cfg.auth.allow_open_bind)
    except ConfigError as exc:
        sys.stderr.write(f"config error: {exc}\n")
        return None
    log = logging.getLogger(f"services.{service}")
    if token:
        log.info(
            "control routes require the API token%s", " (agent routes too)" if cfg.auth.protect_agent_routes else ""
        )
    elif is_loopback(host):
        log.info("no API token set: control routes are open on loopback %s", host)
    else:
        log.warning("no API token set and auth.allow_open_bind: control routes on %s are open to its network", host)
    return cfg

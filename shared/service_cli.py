"""The command line every service shares:
``python -m services.<name> --config RUN.yaml [--port N] [--worker-id ID] [key=value ...]``.

Only argparse and the config loader are imported here, so ``--help`` and config errors are
instant; each service imports its heavy libraries after `load_service_config` succeeded.
"""

from __future__ import annotations

import argparse
import sys

from shared.config import ConfigError, load
from shared.logs import setup_logging
from shared.run_config import RunConfig


def parse_service_args(service: str, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=description)
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--port", type=int, default=None, help=f"port to bind (default: {service}.port; 0: any free port)")
    p.add_argument("--worker-id", default=None, help="registry and consumer name (stable across restarts)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. grpo.max_num_steps=5")
    return p.parse_intermixed_args(argv)


def load_service_config(service: str, args: argparse.Namespace) -> RunConfig | None:
    """Set up logging and load the run config; on a config error print it and return None."""
    setup_logging(service)
    try:
        return load(RunConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return None

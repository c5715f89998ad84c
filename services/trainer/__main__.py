"""streamrl trainer: ``python -m services.trainer --config RUN.yaml [key=value ...]``.

Parses the command line and loads the config before importing torch or transformers, so
``--help`` and config errors are instant.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--port", type=int, default=None, help="REST port (default: trainer.port)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.max_num_steps=5")
    args = parser.parse_args(argv)

    from shared.config import ConfigError, load
    from shared.logs import setup_logging
    from shared.run_config import RunConfig

    setup_logging("trainer")
    try:
        cfg = load(RunConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    import asyncio

    from services.trainer.serve import serve

    return asyncio.run(serve(cfg, args.port))


if __name__ == "__main__":
    sys.exit(main())

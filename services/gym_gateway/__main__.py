"""streamrl gym gateway: ``python -m services.gym_gateway --config RUN.yaml [--port N] [key=value ...]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gym_gateway", description=__doc__)
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--port", type=int, default=None, help="port (default: gym_gateway.port)")
    parser.add_argument("--worker-id", default=None, help="consumer name in the tasks group (stable across restarts)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    args = parser.parse_args(argv)

    from shared.config import ConfigError, load
    from shared.logs import setup_logging
    from shared.run_config import RunConfig

    setup_logging("gym_gateway")
    try:
        cfg = load(RunConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from shared.registry import default_worker_id
    from services.gym_gateway.app import build_app

    port = cfg.gym_gateway.port if args.port is None else args.port
    app = build_app(cfg, worker_id=args.worker_id or default_worker_id("gateway"), port=port)
    # Keep-alive well above the clients' idle expiry, so a pooled connection is never reused
    # just as the server closes it (a ReadError on a healthy rollout).
    uvicorn.run(app, host=cfg.gym_gateway.host, port=port, log_level="warning", timeout_graceful_shutdown=35,
                timeout_keep_alive=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

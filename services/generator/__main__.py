"""``python -m services.generator --config FILE [key=value ...] [--port N] [--worker-id ID]``

Parses the command line, sets the environment vLLM needs *before* anything imports it, loads the
run config (file, environment, dotted overrides), binds the port (0: any free port; the bound
port is logged and registered) and serves the app with uvicorn. SIGTERM: the generator reports
"draining", uvicorn finishes open requests (up to generator.drain_timeout_s), then the lifespan
closes the engine and deregisters. Readiness: GET /ready answers 200.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

# vLLM reads these at import time: loopback-only internal queues, no hub, no telemetry.
ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

log = logging.getLogger("services.generator")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.generator", description="streamrl generator service")
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. policy.generation.backend=transformers")
    p.add_argument("--port", type=int, default=None, help="port to bind (default generator.port; 0: any free port)")
    p.add_argument("--worker-id", default=None, help="registry id (default generator-<host>-<pid>)")
    return p.parse_intermixed_args(argv)


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

    from shared.config import ConfigError, load
    from shared.logs import setup_logging
    from shared.registry import default_worker_id
    from shared.run_config import RunConfig

    setup_logging("generator")
    try:
        cfg = load(RunConfig, args.config, args.overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    host = cfg.generator.host
    sock = bind(host, cfg.generator.port if args.port is None else args.port)
    port = sock.getsockname()[1]
    worker_id = args.worker_id or default_worker_id("generator")

    import uvicorn

    from services.generator.app import begin_drain, build_app

    app = build_app(cfg, worker_id, port)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            begin_drain(app)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=int(cfg.generator.drain_timeout_s),
        timeout_keep_alive=120,
    )
    log.info("generator %s listening on %s:%d (backend %s)", worker_id, host, port, cfg.policy.generation.backend)
    DrainingServer(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

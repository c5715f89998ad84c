"""``python -m services.generator --config FILE [key=value ...] [--port N] [--worker-id ID]``

Parses the command line, sets the environment vLLM needs *before* anything imports it, loads the
run config (file, environment, dotted overrides), binds the port (0: any free port; the bound
port is logged and registered) and serves the app with uvicorn. SIGTERM (scale-down): the
generator reports "draining" and, still listening, serves the sessions it already has until none
has called for generator.drain_session_idle_s (new sessions get 503 and go elsewhere), at most
generator.drain_timeout_s (`shared.serve`); then uvicorn stops and the lifespan closes the engine
and deregisters. A second signal stops at once. Readiness: GET /ready answers 200.
"""

from __future__ import annotations

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


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> int:
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("generator", "streamrl generator: vLLM behind an OpenAI-compatible API", argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    cfg = load_service_config("generator", args)
    if cfg is None:
        return 2
    from shared.registry import default_worker_id

    host = cfg.generator.host
    sock = bind(host, cfg.generator.port if args.port is None else args.port)
    port = sock.getsockname()[1]
    worker_id = args.worker_id or default_worker_id("generator")

    import uvicorn

    from services.generator.app import begin_drain, build_app
    from shared.serve import DrainFirstServer

    app = build_app(cfg, worker_id, port)
    gen_cfg = cfg.generator

    async def drain() -> None:
        begin_drain(app)  # "draining" in the registry at once: gateways stop routing new sessions here
        await app.state.runtime.drain_sessions(gen_cfg.drain_session_idle_s, gen_cfg.drain_timeout_s)

    config = uvicorn.Config(
        app,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=int(cfg.generator.drain_timeout_s),
        timeout_keep_alive=120,
    )
    log.info("generator %s listening on %s:%d (backend %s)", worker_id, host, port, cfg.policy.generation.backend)
    DrainFirstServer(config, drain, drain_timeout_s=gen_cfg.drain_timeout_s + 5.0).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

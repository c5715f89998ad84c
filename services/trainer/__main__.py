"""streamrl trainer: ``python -m services.trainer --config RUN.yaml [--port N] [key=value ...]``.

Parses the command line and loads the config before importing torch or transformers, so
``--help`` and config errors are instant. Exits 0 when the run finishes, 1 when it fails (or the
policy cannot load); SIGTERM or SIGINT stops the run (a restart resumes from the newest
checkpoint) and the process ends by that signal. Under torchrun it refuses a world size above 1:
the trainer is one rank for now (a multi-rank trainer runs the control plane on rank 0 only).
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("trainer", "streamrl trainer: the async GRPO loop and its REST API", argv)
    cfg = load_service_config("trainer", args)
    if cfg is None:
        return 2
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        # Every rank would run its own scheduler and buffer: refuse rather than train N copies.
        logging.getLogger("services.trainer").error(
            "WORLD_SIZE is %d, but the trainer runs as a single rank for now "
            "(launch it with torchrun --nnodes 1 --nproc-per-node 1)",
            world_size,
        )
        return 2
    import uvicorn

    from services.trainer.app import build_app, stop_run
    from shared.registry import default_worker_id
    from shared.service import advertised_url, bind, run_server

    t = cfg.trainer
    sock = bind(t.host, t.port if args.port is None else args.port)
    port = sock.getsockname()[1]
    worker_id = args.worker_id or default_worker_id("trainer")
    app = build_app(cfg, worker_id=worker_id, url=advertised_url(t.host, port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    return run_server(app, config, drain=lambda: stop_run(app), drain_timeout_s=60.0, sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())

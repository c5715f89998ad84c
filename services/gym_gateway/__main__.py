"""streamrl gym gateway: ``python -m services.gym_gateway --config RUN.yaml [--port N] [key=value ...]``.

SIGTERM (scale-down): the worker drains while the session proxy still listens (`shared.serve`):
it stops reading tasks, lets running rollouts finish (their environments keep reaching the model
through this proxy) within DRAIN_TIMEOUT_S and releases the rest to the group; then uvicorn stops.
"""

from __future__ import annotations

import sys

DRAIN_TIMEOUT_S = 30.0


def main(argv: list[str] | None = None) -> int:
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("gym_gateway", "streamrl gym gateway: task workers and the session proxy", argv)
    cfg = load_service_config("gym_gateway", args)
    if cfg is None:
        return 2
    import uvicorn

    from services.gym_gateway.app import build_app
    from shared.registry import default_worker_id
    from shared.serve import DrainFirstServer

    port = cfg.gym_gateway.port if args.port is None else args.port
    app = build_app(
        cfg, worker_id=args.worker_id or default_worker_id("gateway"), port=port, drain_timeout_s=DRAIN_TIMEOUT_S
    )

    async def drain() -> None:
        worker = getattr(app.state, "worker", None)
        if worker is not None:  # None: the lifespan has not started yet
            await worker.drain(DRAIN_TIMEOUT_S)

    # Keep-alive well above the clients' idle expiry, so a pooled connection is never reused
    # just as the server closes it (a ReadError on a healthy rollout).
    config = uvicorn.Config(
        app,
        host=cfg.gym_gateway.host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=35,
        timeout_keep_alive=120,
    )
    DrainFirstServer(config, drain, drain_timeout_s=DRAIN_TIMEOUT_S + 5.0).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m services.gym_gateway --config FILE [key=value ...] [--port N] [--worker-id ID]``

Parses the command line, loads the run config (file, environment, dotted overrides), binds the
port (0: any free port; the bound port is the one sessions and the registry advertise) and serves
the app (`services.gym_gateway.app`) with `shared.service.run_server`.

SIGTERM (scale-down), or the run's end: the worker drains while the session routes still listen
(environments and agents keep reaching the model through them): it stops reading tasks, lets
running rollouts finish within gym_gateway.drain_timeout_s and releases the rest to the group;
then uvicorn stops and the lifespan closes the clients. A second signal stops at once.

Exit code: 0 at the run's end, 1 when the gateway failed (its worker loop died: the restart policy
acts), 2 on a config error; after SIGTERM or SIGINT it drains and then ends by that signal.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("services.gym_gateway")


def main(argv: list[str] | None = None) -> int:
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("gym_gateway", "streamrl gym gateway: task workers and the session proxy", argv)
    cfg = load_service_config("gym_gateway", args)
    if cfg is None:
        return 2
    from services.gym_gateway.app import build_app, drain
    from shared.registry import default_worker_id
    from shared.service import bind, serve_worker

    gw = cfg.gym_gateway
    sock = bind(gw.host, gw.port if args.port is None else args.port)
    port = sock.getsockname()[1]
    worker_id = args.worker_id or default_worker_id("gateway")
    app = build_app(cfg, worker_id=worker_id, port=port)
    log.info("gym gateway %s listening on %s:%d", worker_id, gw.host, port)
    # The drain's own deadline is drain_timeout_s; releasing what is left takes release_margin_s more.
    limit_s = gw.drain_timeout_s + gw.release_margin_s
    return serve_worker(
        app, sock, drain=drain, drain_timeout_s=limit_s, graceful_timeout_s=limit_s, log_level="warning"
    )


if __name__ == "__main__":
    sys.exit(main())

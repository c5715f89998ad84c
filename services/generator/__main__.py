"""``python -m services.generator --config FILE [key=value ...] [--port N] [--worker-id ID]``

Parses the command line, sets the environment vLLM needs *before* anything imports it
(`services.generator.vllm_env`), loads the run config (file, environment, dotted overrides),
binds the port (0: any free port; the bound port is logged and registered) and serves the app
with `shared.service.run_server`. Readiness: GET /ready answers 200.

SIGTERM (scale-down): the generator reports "draining" and, still listening, serves the sessions
it already has until none has called for generator.drain_session_idle_s (new sessions get 503 and
go elsewhere), at most generator.drain_timeout_s; then uvicorn stops and the lifespan closes the
engine and deregisters. A second signal stops at once. A failed generator (a dead bring-up or
weight watcher) has no sessions to keep: it stops without waiting for them.

Exit code: 1 when the generator failed (the restart policy acts), 2 on a config error; after
SIGTERM or SIGINT it drains and then ends by that signal (uvicorn re-raises it).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("services.generator")


def main(argv: list[str] | None = None) -> int:
    from services.generator.vllm_env import apply_env_defaults
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("generator", "streamrl generator: vLLM behind an OpenAI-compatible API", argv)
    apply_env_defaults()
    cfg = load_service_config("generator", args)
    if cfg is None:
        return 2
    from services.generator.vllm_args import check_vllm_cfg
    from shared.config_error import ConfigError

    try:
        check_vllm_cfg(cfg)  # before the engine's processes start, naming the key
    except ConfigError as exc:
        sys.stderr.write(f"config error: {exc}\n")
        return 2
    from shared.registry import default_worker_id
    from shared.service import bind, serve_worker

    gen_cfg = cfg.generator
    sock = bind(gen_cfg.host, gen_cfg.port if args.port is None else args.port)
    port = sock.getsockname()[1]
    worker_id = args.worker_id or default_worker_id("generator")

    from services.generator.app import build_app, drain

    app = build_app(cfg, worker_id=worker_id, port=port)
    log.info(
        "generator %s listening on %s:%d (backend %s)", worker_id, gen_cfg.host, port, cfg.policy.generation.backend
    )
    return serve_worker(
        app,
        sock,
        drain=drain,
        drain_timeout_s=gen_cfg.drain_timeout_s + 5.0,
        graceful_timeout_s=gen_cfg.drain_timeout_s,
        log_config=None,
    )


if __name__ == "__main__":
    sys.exit(main())

"""streamrl trainer: ``python -m services.trainer --config RUN.yaml [--port N] [key=value ...]``.

Parses the command line and loads the config before importing torch or transformers, so
``--help`` and config errors are instant. Exits 0 when the run finishes, 1 when it fails (or the
policy cannot load); SIGTERM or SIGINT stops the run within ``trainer.drain_timeout_s`` (a
restart resumes from the newest checkpoint) and the process ends by that signal.

With more than one rank (``trainer.nproc_per_node`` x ``trainer.nnodes``) and no launcher around
it, the process replaces itself with torchrun (``--standalone`` on one node, c10d rendezvous at
``trainer.rdzv_endpoint`` on many: `services.trainer.launch`) and the same arguments. Under
torchrun (``WORLD_SIZE`` > 1) every rank joins the trainer's process group; rank 0 serves
the REST API and runs the control plane with a `RankedLearner`, every other rank builds its shard
of the learner and follows rank 0's commands (`services.trainer.rank_learner`) until the run ends.
A follower whose command fails exits 1 (torchrun then stops the others).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.trainer.learner import Learner
    from shared.run_config import RunConfig

log = logging.getLogger("services.trainer")


def main(argv: list[str] | None = None) -> int:
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("trainer", "streamrl trainer: the async GRPO loop and its REST API", argv)
    cfg = load_service_config("trainer", args)
    if cfg is None:
        return 2
    from services.trainer.launch import launcher, preflight
    from services.trainer.ranks import launched_world_size
    from shared.config_error import ConfigError
    from shared.netaddr import Unreachable

    launched = "LOCAL_RANK" in os.environ or launched_world_size() > 1  # torchrun, or a cluster launcher
    world = launched_world_size() if launched else cfg.trainer.nproc_per_node * cfg.trainer.nnodes
    try:  # a layout that cannot fit, or a rendezvous out of reach, is refused before any rank starts
        preflight(cfg, world, launched=launched)
    except (ConfigError, Unreachable) as exc:
        log.error("%s", exc)
        return 2
    if world > 1 and not launched:  # not started by a launcher: become one
        command = [*launcher(cfg), "-m", "services.trainer", *(sys.argv[1:] if argv is None else argv)]
        log.info(
            "trainer ranks: %d node(s) x %d: %s", cfg.trainer.nnodes, cfg.trainer.nproc_per_node, " ".join(command)
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *command])
    if launched_world_size() > 1:
        return _ranked(cfg, args.port, args.worker_id)
    return _serve(cfg, args.port, args.worker_id)


def _serve(cfg: RunConfig, port: int | None, worker_id: str | None, learner: Learner | None = None) -> int:
    import uvicorn

    from services.trainer.app import build_app, stop_run
    from shared.registry import default_worker_id
    from shared.service import advertised_url, bind, run_server

    t = cfg.trainer
    sock = bind(t.host, t.port if port is None else port)
    bound = sock.getsockname()[1]
    app = build_app(
        cfg,
        worker_id=worker_id or default_worker_id("trainer"),
        url=advertised_url(t.host, bound, cfg.redis.url),
        learner=learner,
    )
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    return run_server(app, config, drain=lambda: stop_run(app), drain_timeout_s=t.drain_timeout_s, sockets=[sock])


def _ranked(cfg: RunConfig, port: int | None, worker_id: str | None) -> int:
    """One rank of a trainer of many: rank 0 serves, the others follow."""
    from services.trainer.backends import build_backend
    from services.trainer.rank_learner import RankedLearner, follow
    from services.trainer.ranks import join, leave

    timeout_s = cfg.trainer.collective_timeout_s
    ranks = join(timeout_s)
    code = 1
    try:
        if ranks.is_root:
            learner = RankedLearner(lambda: build_backend(cfg, ranks), ranks, collective_timeout_s=timeout_s)
            code = _serve(cfg, port, worker_id, learner)
            return code
        try:
            follow(build_backend(cfg, ranks))
        except Exception:
            log.exception("trainer rank %d of %d failed", ranks.rank, ranks.world_size)
            return 1
        code = 0
        return code
    finally:
        leave(ranks if code == 0 else None)


if __name__ == "__main__":
    sys.exit(main())

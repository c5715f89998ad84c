"""streamrl trainer: ``python -m services.trainer --config RUN.yaml [key=value ...]``.

Parses the command line and loads the config before importing torch or transformers, so
``--help`` and config errors are instant. Under torchrun it refuses a world size above 1: the
trainer is one rank for now (a multi-rank trainer would keep the loop on rank 0 only).
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
    import asyncio

    from services.trainer.serve import serve

    return asyncio.run(serve(cfg, args.port, worker_id=args.worker_id))


if __name__ == "__main__":
    sys.exit(main())

"""streamrl trainer: ``python -m services.trainer --config RUN.yaml [key=value ...]``.

Parses the command line and loads the config before importing torch or transformers, so
``--help`` and config errors are instant.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from shared.service_cli import load_service_config, parse_service_args

    args = parse_service_args("trainer", "streamrl trainer: the async GRPO loop and its REST API", argv)
    cfg = load_service_config("trainer", args)
    if cfg is None:
        return 2
    import asyncio

    from services.trainer.serve import serve

    return asyncio.run(serve(cfg, args.port, worker_id=args.worker_id))


if __name__ == "__main__":
    sys.exit(main())

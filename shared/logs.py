"""Process-wide logging setup: standard `logging`, configured once per process."""

from __future__ import annotations

import logging
import os
import sys

_configured = False


def setup_logging(service: str, level: str | None = None) -> None:
    """Log to stderr as ``time level service logger: message``; level from STREAMRL_LOG_LEVEL."""
    global _configured
    if _configured:
        return
    _configured = True
    lvl = (level or os.environ.get("STREAMRL_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    for noisy in ("httpx", "httpcore", "uvicorn.access", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

"""Process-wide logging setup: standard `logging`, configured once per process.

Every line goes through `RedactingFormatter`: the password of any URL in it (a Redis URL in an
error message) and the API token are masked, whatever library wrote the line.
"""

from __future__ import annotations

import logging
import os
import sys

from shared.auth import load_api_token, redact_text
from shared.config_error import ConfigError

_configured = False


def setup_logging(service: str, level: str | None = None) -> None:
    """Log to stderr as ``time level service logger: message``; level from STREAMRL_LOG_LEVEL."""
    global _configured
    if _configured:
        return
    _configured = True
    lvl = (level or os.environ.get("STREAMRL_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    for noisy in ("httpx", "httpcore", "uvicorn.access", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RedactingFormatter(logging.Formatter):
    """A formatter that masks URL passwords and the API token (read from the environment once)."""

    def __init__(self, fmt: str | None = None, datefmt: str | None = None) -> None:
        super().__init__(fmt, datefmt)
        try:
            self._token = load_api_token()
        except ConfigError:  # reported by the service's start-up check
            self._token = None

    def format(self, record: logging.LogRecord) -> str:
        text = redact_text(super().format(record))
        return text.replace(self._token, "***") if self._token else text

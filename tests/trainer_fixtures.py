"""The trainer's control plane and REST app on the tiny model, for integration tests: a config on
the test's Valkey, a control plane opened (policy loaded, groups made) but not running its loop,
and the app serving it in-process."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from services.trainer.app import build_app
from services.trainer.backends import build_backend
from services.trainer.control_plane import ControlPlane, TrainerHooks
from services.trainer.learner import LocalLearner
from shared.auth import AuthPolicy
from shared.config import decode_tree
from shared.run_config import RunConfig


def trainer_config(tmp_path: Path, redis_url: str, model_dir: Path, prefix: str, **sections: Any) -> RunConfig:
    """A run of two crossing prompts (train and validation data), groups of two; ``sections``
    are merged over it, section by section."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"env": "crossing", "instance": {"light": c}}) + "\n" for c in ("red", "green")))
    tree: dict[str, Any] = {
        "run": {"run_id": f"{prefix}-{uuid.uuid4().hex[:8]}", "output_dir": str(tmp_path / "out")},
        "redis": {"url": redis_url},
        "data": {"train_path": str(data), "val_path": str(data)},
        "policy": {"model_name": str(model_dir)},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    cfg = decode_tree(tree, RunConfig)
    cfg.check()
    return cfg


def control_plane(cfg: RunConfig, hooks: TrainerHooks | None = None, url: str = "http://test") -> ControlPlane:
    """The control plane with the configured backend, as the trainer service builds it (not
    opened); ``url`` is the address it registers (where `streamrl status` looks for it)."""
    return ControlPlane(
        cfg,
        LocalLearner(lambda: build_backend(cfg)),
        worker_id=f"trainer-{uuid.uuid4().hex[:6]}",
        url=url,
        hooks=hooks,
    )


def serving_app(cfg: RunConfig, control: ControlPlane, auth: AuthPolicy | None = None) -> FastAPI:
    """The trainer's REST app around ``control``, without running its loop."""
    return build_app(cfg, worker_id=control.worker_id, url=control.url, control=control, run=False, auth=auth)

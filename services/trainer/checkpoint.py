"""Trainer checkpoints: model + optimizer + scheduler cursor + consumed-id ledger, per step.

Layout: ``<checkpoint_dir>/step_000010/{trainer_state.pt, meta.json}``, written to a temporary
folder and renamed, so a crash mid-save leaves the previous checkpoint intact. The newest complete
one is restored at start-up. Called by the trainer runtime.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> Path:
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "saved_at": time.time()}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(ckpt_dir.glob("step_[0-9]*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint saved: %s", final)
    return final


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = sorted(p for p in ckpt_dir.glob("step_[0-9]*") if (p / "meta.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    meta = json.loads((path / "meta.json").read_text())
    return state, meta

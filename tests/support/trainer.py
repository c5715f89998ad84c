"""The trainer's control plane and REST app on the tiny model, for integration tests: a config on
the test's Valkey, a control plane opened (policy loaded, groups made) but not running its loop,
and the app serving it in-process; or its loop running against played peers (`play`), waited for
(`run_to_end`) and stopped (`stop_plane`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from redis.asyncio import Redis

from services.trainer.app import build_app
from services.trainer.backends import build_backend
from services.trainer.control_plane import ControlPlane, TrainerHooks
from services.trainer.learner import LocalLearner
from shared.auth import AuthPolicy
from shared.config import decode_tree
from shared.run_config import RunConfig
from shared.tasks import cancel_and_wait
from tests.support.peers import Peers


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


@contextlib.asynccontextmanager
async def opened_plane(cfg: RunConfig) -> AsyncIterator[tuple[ControlPlane, httpx.AsyncClient]]:
    """The control plane of ``cfg`` opened (its loop not running) and a client of its REST app;
    the plane closed after."""
    rt = control_plane(cfg)
    await rt.open()
    app = serving_app(cfg, rt)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
        yield rt, client
    await rt.aclose()


async def run_to_end(
    run: asyncio.Task[None], timeout_s: float, where: Callable[[], Awaitable[str]] | None = None
) -> None:
    """Wait for the control plane's loop ``run`` to end and raise what it raised. Past
    ``timeout_s`` the test fails, saying ``where`` the run stood, and the run is stopped
    (`shared.tasks.cancel_and_wait`: one cancel can be lost in the Redis client, and
    ``asyncio.wait_for`` would then wait for ever)."""
    done, _ = await asyncio.wait({run}, timeout=timeout_s)
    if not done:
        stood = await where() if where is not None else ""
        await cancel_and_wait([run], timeout_s=30.0)
        raise AssertionError(f"the run did not end within {timeout_s:.0f}s{': ' + stood if stood else ''}")
    run.result()


async def stop_plane(control: ControlPlane, peers_redis: Redis, *loops: asyncio.Task[None] | None) -> None:
    """Stop ``loops`` (the run, the played peers), then close ``control`` and the peers' Redis;
    fails if a loop is still running 30 s later (`shared.tasks`: a cancel can be lost in the
    Redis client, so it is repeated)."""
    stuck = await cancel_and_wait([t for t in loops if t is not None], timeout_s=30.0)
    await control.aclose()
    await peers_redis.aclose()
    assert not stuck, f"still running 30s after they were stopped: {stuck}"


async def play(control: ControlPlane, redis_url: str) -> tuple[Peers, asyncio.Task[None], asyncio.Task[None]]:
    """``control`` opened and its loop started, against a played generator and gateway
    (`tests.support.peers.Peers`, started first): (peers, the peers' loop, the run). Stop them with
    `stop_plane` (``peers.redis`` is theirs)."""
    peers = Peers(redis_url, control.keys)
    peer_task = asyncio.create_task(peers.run())
    await control.open()
    return peers, peer_task, asyncio.create_task(control.run())

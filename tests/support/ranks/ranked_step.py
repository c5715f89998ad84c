"""Train a fixed batch on the trainer's learner at any world size, as the trainer does.

    torchrun --nproc-per-node N tests/support/ranks/ranked_step.py MODEL OUT [--steps K] [--save] [--load CKPT]
    python tests/support/ranks/ranked_step.py MODEL OUT ...          (one rank)

Rank 0 drives a `RankedLearner` (one rank: a `LocalLearner`), every other rank `follow`s, exactly
as ``python -m services.trainer`` under torchrun wires them, minus the control plane. Rank 0
writes OUT/metrics.json (each step's LearnerMetrics), OUT/weights (the published weights, float32,
in files of at most --max-weight-file-bytes) with OUT/manifest.json (what `export_weights`
returned), and with --save OUT/ckpt (a learner checkpoint after the last step). Every rank R
writes OUT/manifest-rankR.json, what its backend's `save_weights` returned, and
OUT/load-rankR.json, the bytes it read of the checkpoint when it read only its shards (null when
it loaded it whole). --load restores a learner checkpoint (written at any world size) before
training. --kill-rank R --kill-step S: rank R
kills itself (SIGKILL) inside step S's first forward pass. --nan-step S [--nan-rank R]: rank R
(default every rank) puts a NaN into one parameter's gradient in step S
(`tests.support.gradients`) and writes that parameter's name to OUT/poisoned-rankR.txt. With
``--set policy.moe_routing_replay=true`` the rows carry routes (`batch`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from services.trainer.backends import build_backend  # noqa: E402
from services.trainer.backends.backend import Backend  # noqa: E402
from services.trainer.batch import Row, StepBatch  # noqa: E402
from services.trainer.learner import Learner, LocalLearner  # noqa: E402
from services.trainer.rank_learner import RankedLearner, follow  # noqa: E402
from services.trainer.ranks import SINGLE, join, launched_world_size, leaving  # noqa: E402
from shared.config import load  # noqa: E402
from shared.routes import RouteShape, route_shape  # noqa: E402
from shared.run_config import RunConfig  # noqa: E402
from tests.support.gradients import mlp_weight, poison_gradient  # noqa: E402


def config(model: str, extra: list[str]) -> RunConfig:
    return load(
        RunConfig,
        None,
        [
            f"policy.model_name={model}",
            "data.train_path=t.jsonl",
            "policy.optimizer.lr=1e-5",
            "policy.train_micro_batch_size=2",
            "grpo.num_prompts_per_step=3",
            "grpo.num_generations_per_prompt=4",
            "trainer.torch_threads=1",
            "trainer.collective_timeout_s=60",
            *extra,
        ],
        env={},
    )


def batch(step: int, routes: RouteShape | None = None) -> StepBatch:
    """12 rows of lengths 9..30, half of their tokens generated, advantages of both signs; with
    ``routes``, random routes of all but their last position on every row but each fourth."""
    rng = np.random.default_rng(100 + step)
    rows = []
    for i in range(12):
        n = int(rng.integers(9, 31))
        ids = rng.integers(10, 800, size=n).astype(np.int64)
        tmask = np.zeros(n, np.float32)
        tmask[n // 2 :] = 1.0
        glp = (-rng.uniform(0.5, 6.0, size=n) * tmask).astype(np.float32)
        adv = float(rng.normal())
        rows.append(Row(f"s{step}-t{i}", f"g{i // 4}", ids, tmask, glp, reward=adv, advantage=adv))
    if routes is not None:
        drawn = np.random.default_rng(200 + step)
        for r in rows[1::4] + rows[2::4] + rows[3::4]:
            draws = drawn.random((len(r.input_ids) - 1, routes.layers, routes.num_experts))
            r.routes = np.argsort(draws, axis=-1)[..., : routes.top_k]
    return StepBatch(rows=rows)


async def drive(learner: Learner, args: argparse.Namespace, out: Path, routes: RouteShape | None) -> None:
    await learner.start()
    if args.load:
        await learner.load(Path(args.load))
    steps = range(args.first_step, args.first_step + args.steps)
    metrics = [await learner.train(batch(s, routes)) for s in steps]
    (out / "metrics.json").write_bytes(msgspec.json.encode(metrics))
    manifest = await asyncio.to_thread(learner.export_weights, out / "weights")
    (out / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    if args.save:
        (out / "ckpt").mkdir(exist_ok=True)
        await learner.save(out / "ckpt")
        await learner.wait_saved()
    await learner.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--save", action="store_true")
    p.add_argument("--load")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--nan-rank", type=int, default=-1, help="-1: every rank")
    p.add_argument("--max-weight-file-bytes", type=int, default=None)
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(args.model, args.set)
    routes = None  # the rows' routes' shape, with policy.moe_routing_replay
    if cfg.policy.moe_routing_replay:
        routes = route_shape(json.loads((Path(args.model) / "config.json").read_text()))
    ranks = join(cfg.trainer.collective_timeout_s) if launched_world_size() > 1 else SINGLE

    def build() -> Backend:
        backend = build_backend(cfg, ranks, max_weight_file_bytes=args.max_weight_file_bytes)
        if ranks.rank == args.kill_rank:
            _kill_in_step(backend, args.kill_step - args.first_step)
        if args.nan_step >= 0 and args.nan_rank in (-1, ranks.rank):
            name = mlp_weight(backend)
            (out / f"poisoned-rank{ranks.rank}.txt").write_text(name)
            updates_a_step = len(backend.plan(batch(0))[0].updates)
            poison_gradient(backend, name, at_update=(args.nan_step - args.first_step) * updates_a_step)
        _record_manifest(backend, out / f"manifest-rank{ranks.rank}.json")
        (out / f"load-rank{ranks.rank}.json").write_text(json.dumps({"bytes_read": backend.checkpoint_bytes_read}))
        return backend

    with leaving(ranks):
        if not ranks.sharded:
            asyncio.run(drive(LocalLearner(build), args, out, routes))
        elif ranks.is_root:
            learner = RankedLearner(build, ranks, collective_timeout_s=cfg.trainer.collective_timeout_s)
            asyncio.run(drive(learner, args, out, routes))
        else:
            follow(build())
    return 0


def _record_manifest(backend: Backend, path: Path) -> None:
    """Write what the backend's ``save_weights`` returns to ``path``."""
    inner = backend.save_weights

    def save_weights(out_dir: Path) -> dict[str, str]:
        manifest = inner(out_dir)
        path.write_bytes(msgspec.json.encode(manifest))
        return manifest

    backend.save_weights = save_weights  # type: ignore[method-assign]


def _kill_in_step(backend: Backend, step: int) -> None:
    """SIGKILL this process in the first forward pass of its ``step``-th train_share."""
    calls = {"n": 0}
    inner = backend.train_share

    def train_share(share):  # type: ignore[no-untyped-def]
        if calls["n"] == step:
            forward = backend.adapter.logits

            def dying(*a, **kw):  # type: ignore[no-untyped-def]
                os.kill(os.getpid(), signal.SIGKILL)
                return forward(*a, **kw)

            backend.adapter.logits = dying  # type: ignore[method-assign]
        calls["n"] += 1
        return inner(share)

    backend.train_share = train_share  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())

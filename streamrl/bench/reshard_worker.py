"""A trainer of one or many ranks that only publishes: it loads the run's policy, waits for the
run's generators, refits them ``--refits`` times through the run's weight transport
(`services.trainer.refit.WeightPublisher`, as the trainer's control plane does) and writes each
refit's report as JSON; with ``--export`` it then writes the policy as a safetensors folder (what
an engine started cold on the same weights loads). Launched under ``torchrun`` for many ranks
(rank 0 publishes, the others follow its commands, as in the trainer), plainly for one.

Used by the resharding refit's benchmark (`streamrl.bench.reshard`) and its engine tests
(tests/integration/test_reshard_engines.py)::

    torchrun --nproc_per_node 2 -m streamrl.bench.reshard_worker --config run.yaml --generators 1 \\
        --refits 3 --out refits.json --export folder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--generators", type=int, required=True, help="wait for this many ready generators")
    parser.add_argument("--refits", type=int, default=1)
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause between refits")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--export", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from services.trainer.backends import build_backend
    from services.trainer.learner import LocalLearner
    from services.trainer.rank_learner import RankedLearner, follow
    from services.trainer.ranks import join, launched_world_size, leave
    from shared.config import load
    from shared.run_config import RunConfig

    cfg = load(RunConfig, args.config, env={})
    if launched_world_size() <= 1:
        asyncio.run(_publish(cfg, LocalLearner(lambda: build_backend(cfg)), args))
        return 0
    ranks = join(cfg.trainer.collective_timeout_s)
    code = 1
    try:
        if ranks.is_root:
            learner = RankedLearner(
                lambda: build_backend(cfg, ranks), ranks, collective_timeout_s=cfg.trainer.collective_timeout_s
            )
            asyncio.run(_publish(cfg, learner, args))
        else:
            follow(build_backend(cfg, ranks))
        code = 0
    finally:
        leave(ranks if code == 0 else None)
    return code


async def _publish(cfg, learner, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from services.trainer.refit import WeightPublisher
    from services.trainer.refit_probe import build_probe
    from services.trainer.weight_transport import build_transport
    from shared.keys import RunKeys
    from shared.pause import PauseControl
    from shared.registry import live_workers
    from shared.streams import StreamClient, connect

    redis = connect(cfg.redis.url)
    keys = RunKeys(cfg.run.run_id)
    try:
        await learner.start()
        deadline = time.monotonic() + 600
        while True:
            ready = [
                g for g in await live_workers(redis, keys, "generator") if g.state in ("ready", "awaiting_weights")
            ]
            if len(ready) >= args.generators:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ready)} of {args.generators} generators ready after 600 s")
            await asyncio.sleep(0.2)
        out = Path(cfg.run.output_dir)
        transport = build_transport(cfg, learner, out / "weights", redis, keys)
        publisher = WeightPublisher(
            StreamClient(redis, keys, "trainer"),
            PauseControl(redis, keys),
            transport,
            timeout_s=cfg.trainer.refit_timeout_s,
            in_flight_updates=False,
            max_attempts=cfg.refit.max_attempts,
            probe=build_probe(cfg, learner.probe),
        )
        reports = []
        for version in range(1, args.refits + 1):
            report = await publisher.refit(version)
            reports.append({"version": version, **_as_dict(report)})
            log.info("refit %d: %.3fs", version, report.total_s)
            await asyncio.sleep(args.settle_s)
        await transport.aclose()
        if args.export is not None:
            args.export.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(learner.export_weights, args.export)
        args.out.write_text(json.dumps({"refits": reports}, indent=2))
    finally:
        await learner.close()
        await redis.aclose()


def _as_dict(report: object) -> dict[str, object]:
    import msgspec

    return msgspec.to_builtins(report)  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())

"""The simulated parts of the pipeline benchmark (`streamrl.bench.pipeline`), around the real
trainer control plane and real gateway workers:

* `SimBackend`: the learner's backend; a step sleeps the scenario's training time and the weights
  are a 64-byte file;
* `SleepEnv` (`streamrl.bench.sleep_env`): the rollouts, each a seeded log-normal sleep, so the
  real run and the ideal schedule see the same rollout times;
* `SimGenerator`: in a process of its own, registers a generator heartbeat and confirms every
  weight announcement at once (the heartbeat carries the new version before the ack);
* `serve_gateways`: GATEWAY_WORKERS `GatewayWorker`s built as the gateway app builds one (tasks
  stream in, one session per rollout through the real `SessionProxy`, trajectories out), in a
  process of their own as in a deployment.

`serve` is the entry point of the helper processes `spawn` starts; the gateways' process ends by
writing a `GatewayReport`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import torch

from services.gym_gateway.proxy import GeneratorPool, SessionProxy
from services.gym_gateway.worker import GatewayWorker
from services.trainer.backends.layout import data_parallel
from services.trainer.batch import StepBatch
from services.trainer.ranks import SINGLE
from services.trainer.step_plan import RankShare
from shared import keys as K
from shared.protocol import Heartbeat, WeightAck, WeightAnnouncement
from shared.records import LearnerMetrics
from shared.registry import HeartbeatTask, publish_heartbeat
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect
from shared.weights_format import write_hashed
from streamrl.bench.schedule import Scenario
from streamrl.bench.sleep_env import SleepEnv, registered_env
from streamrl.child_guard import guarded

GATEWAY_WORKERS = 8  # x gym_gateway.max_concurrent_rollouts (64): far above the peak, slots never limit generation
ROOT = Path(__file__).resolve().parents[2]


class GatewayReport(msgspec.Struct):
    """What the gateways' process reports when the run ends."""

    peak_rollouts: int  # running at once
    rollouts_started: int
    failed_rollouts: dict[str, int]  # by reason


class SimBackend:
    """A training backend whose step takes ``train_s`` and whose weights are 64 bytes; the
    benchmark plugs it into the real control plane as its learner's backend."""

    name = "sim"
    dtype = torch.float32

    def __init__(self, train_s: float) -> None:
        self.train_s = train_s
        self.spans: list[tuple[float, float]] = []  # perf_counter start, end of every train_step
        self.layout = data_parallel(SINGLE)

    def plan(self, batch: StepBatch) -> list[RankShare]:
        raise NotImplementedError("one rank: the benchmark's learner calls train_step")

    def train_share(self, share: RankShare | None) -> LearnerMetrics:
        raise NotImplementedError("one rank: the benchmark's learner calls train_step")

    @classmethod
    def from_config(cls, cfg: RunConfig) -> SimBackend:
        raise NotImplementedError("built by the benchmark with its scenario's training time")

    def train_step(self, batch: StepBatch) -> LearnerMetrics:
        t0 = time.perf_counter()
        time.sleep(self.train_s)
        self.spans.append((t0, time.perf_counter()))
        return LearnerMetrics(
            loss=0.0, grad_norm=0.0, num_updates=1, train_tokens=0, lr=0.0, train_time_s=time.perf_counter() - t0
        )

    def save_weights(self, out_dir: Path) -> dict[str, str]:
        return {"model.safetensors": write_hashed(out_dir / "model.safetensors", bytes(64))}

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError("the benchmark's runs publish weights as files (refit.transport: filesystem)")

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError("the benchmark's runs publish weights as files (refit.transport: filesystem)")

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return [0.0] * (len(token_ids) - 1)  # no model: the benchmark's generators score nothing either

    def weight_shards(self) -> Any:
        raise NotImplementedError("the benchmark's runs publish weights as files (refit.transport: filesystem)")

    def save_checkpoint(self, path: Path) -> None:
        raise NotImplementedError("the benchmark's runs keep no checkpoints")

    def wait_for_save(self) -> None:
        return None

    def load_checkpoint(self, path: Path) -> None:
        raise NotImplementedError("the benchmark's runs keep no checkpoints")


class SimGenerator:
    """Plays a generator: a registry heartbeat, and an immediate ack of every weight announcement
    (the heartbeat carries the new version before the ack goes out). Ends when the run stops."""

    def __init__(self, redis_url: str, run_id: str) -> None:
        self.worker_id = "generator-sim"
        self.redis = connect(redis_url)
        self.streams = StreamClient(self.redis, K.RunKeys(run_id), self.worker_id)
        self.version = -1

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            kind="generator",
            url="http://generator.sim",
            state="ready",
            weight_version=self.version,
        )

    async def run(self) -> None:
        keys = self.streams.keys
        await publish_heartbeat(self.redis, keys, self._heartbeat())
        heartbeat = HeartbeatTask(self.redis, keys, self._heartbeat)
        heartbeat.start()
        cursor = "0-0"
        try:
            while not await self.redis.exists(keys.stop):
                for d in await self.streams.read_after(keys.weights, cursor, WeightAnnouncement, block_ms=200):
                    cursor = d.entry_id
                    if d.msg is None:  # an unreadable entry, dead-lettered
                        continue
                    self.version = d.msg.version
                    await publish_heartbeat(self.redis, keys, self._heartbeat())
                    ack = WeightAck(worker_id=self.worker_id, version=self.version, ok=True, cache_reset=True)
                    await self.streams.publish(keys.weight_acks, ack)
        finally:
            await heartbeat.aclose(self.worker_id)
            await self.redis.aclose()


async def serve_gateways(cfg: RunConfig, redis_url: str, scenario: Scenario, report: Path) -> None:
    """GATEWAY_WORKERS gateway workers as `services.gym_gateway.app` builds one (own Redis client,
    session proxy, the config's slots), sharing one process; they end when the run stops."""
    env = SleepEnv(scenario)
    keys = K.RunKeys(cfg.run.run_id)
    gw = cfg.gym_gateway
    http = aiohttp.ClientSession()
    clients, workers = [], []
    with registered_env(env):
        for i in range(GATEWAY_WORKERS):
            redis = connect(redis_url)
            gateway_id = f"gateway-sim-{i}"
            pool = GeneratorPool(redis, keys, refresh_s=0.0)
            proxy = SessionProxy(pool, http, request_timeout_s=gw.request_timeout_s)
            clients.append(redis)
            workers.append(
                GatewayWorker(
                    StreamClient(redis, keys, gateway_id),
                    proxy,
                    http,
                    env_cfg=cfg.env,
                    session_base_url="http://gateway.sim",
                    max_concurrent=gw.max_concurrent_rollouts,
                    reclaim_idle_s=gw.reclaim_idle_s,
                    gateway_id=gateway_id,
                )
            )
        try:
            await asyncio.gather(*(w.run() for w in workers))
        finally:
            for w in workers:
                await w.drain(0.0)  # stragglers still running when the last step ended
            await http.close()
            for redis in clients:
                await redis.aclose()
    failed: dict[str, int] = defaultdict(int)
    for w in workers:
        for reason, n in w.failed.items():
            failed[reason] += n
    report.write_bytes(msgspec.json.encode(GatewayReport(env.peak, sum(env.started.values()), dict(failed))))


def serve(argv: list[str]) -> None:
    """Entry point of a helper process: ``generator|gateway <config.json> <scenario.json> <report.json>``."""
    role, config, scenario, report = argv
    cfg = msgspec.json.decode(Path(config).read_bytes(), type=RunConfig)
    redis_url = cfg.redis.url
    assert redis_url, "the benchmark writes its Redis URL into the config"
    if role == "generator":
        asyncio.run(SimGenerator(redis_url, cfg.run.run_id).run())
    else:
        s = Scenario(**json.loads(Path(scenario).read_text()))
        asyncio.run(serve_gateways(cfg, redis_url, s, Path(report)))


def spawn(role: str, work: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from streamrl.bench.pipeline_sim import serve; serve(sys.argv[1:])",
        role,
        str(work / "config.json"),
        str(work / "scenario.json"),
        str(work / f"{role}.report.json"),
    ]
    with open(work / f"{role}.log", "wb") as log:
        return subprocess.Popen(guarded(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

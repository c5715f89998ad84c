"""A gym gateway over the session's Valkey, served on loopback ports in the test's event loop, and
what the gateway tests read back from it. The fixtures that hand these out live in
tests/integration/conftest.py.

* `serve`: ``async with serve(app, port) as url`` serves an ASGI app with uvicorn on a loopback
  port, lifespan included, and stops it on exit.
* `gateway_stack`: ``async with gateway_stack(...)(...) as stack`` starts generator(s)
  (transformers engine, weights v0 confirmed) and a gateway, on a fresh run id;
  ``stack.stop_generator(i)`` stops one generator mid-test.
* `scripted_gateway`: the same with `tests.support.fakes.generator.ScriptedGenerator` playing
  ``policies`` as the only generator: real worker, environments and session proxy, no model.
* `collect`, `run_tasks`, `counter_by_reason`: trajectories and counters a test reads back.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from redis.asyncio import Redis

from shared import keys as K
from shared.config import load
from shared.protocol import SamplingParams, Task, Trajectory, WeightAnnouncement
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect
from shared.weights_format import checksum_dir, dir_num_bytes
from streamrl.redis_server import free_port
from tests.support.messages import make_task
from tests.support.redis import wait_ack


class _Served:
    def __init__(self, app, port: int) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        self.server.install_signal_handlers = lambda: None
        self.url = f"http://127.0.0.1:{port}"
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.02)
        return self.url

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 60)


@contextlib.asynccontextmanager
async def serve(app, port: int):
    served = _Served(app, port)
    await served.start()
    try:
        yield served.url
    finally:
        await served.stop()


def gateway_task(
    i: int, env: str = "crossing", instance: dict | None = None, *, deadline_s: float = 60.0, max_tokens: int = 12
) -> Task:
    """Group ``g{i}`` of one rollout (the red light of ``crossing`` unless ``instance`` says)."""
    sampling = SamplingParams(max_tokens=max_tokens)
    return make_task(
        f"g{i}",
        env=env,
        instance=instance or {"light": "red"},
        prompt_index=i,
        sampling=sampling,
        deadline_s=deadline_s,
    )


async def collect(streams: StreamClient, n: int, timeout_s: float = 60) -> list[Trajectory]:
    out: list[Trajectory] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(out) < n and asyncio.get_running_loop().time() < deadline:
        got = await streams.read_group(streams.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=10, block_ms=200)
        out += [d.msg for d in got]
    return out


def single_task(
    group_id: str, env: str, instance: dict[str, Any], *, sampling: SamplingParams | None = None, **fields: Any
) -> Task:
    """A group of one rollout (task id ``group_id/0``) for target step 0, 16 tokens a call unless
    ``sampling`` says; ``fields``: ``prompt_index``, ``kind``, ``deadline_s`` (`make_task`)."""
    return make_task(group_id, env=env, instance=instance, sampling=sampling or SamplingParams(max_tokens=16), **fields)


def crossing_task(head: str, i: int, env: str = "crossing") -> Task:
    """A one-rollout training task named ``head-i`` (crossing: the green light)."""
    return single_task(f"{head}-{i}", env, {"light": "green"} if env == "crossing" else {}, prompt_index=i)


async def run_tasks(stack: Stack, tasks: list[Task]) -> dict[str, Trajectory]:
    """Publish ``tasks`` and collect one trajectory each, by the head of its group id."""
    await stack.streams.publish_many(stack.streams.keys.tasks, tasks)
    trajs = await collect(stack.streams, len(tasks), timeout_s=120)
    assert len(trajs) == len(tasks)
    return {t.group_id.split("-")[0]: t for t in trajs}


async def counter_by_reason(stack: Stack, family: str) -> dict[str, float]:
    """The Prometheus counter ``family`` by its ``reason`` label, from GET /metrics; and /ready
    answers 200 (the worker still serves)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=stack.url) as http:
        assert (await http.get("/ready")).status_code == 200
        text = (await http.get("/metrics")).text
    [found] = [f for f in text_string_to_metric_families(text) if f.name == family]
    return {s.labels["reason"]: s.value for s in found.samples if s.name.endswith("_total")}


@dataclass
class Stack:
    cfg: RunConfig
    gateway: Any  # the gateway FastAPI app (state.proxy, state.worker)
    streams: StreamClient  # plays the trainer
    url: str  # the gateway's base URL
    generators: list[_Served] = field(default_factory=list)

    async def stop_generator(self, i: int) -> None:
        await self.generators[i].stop()


def run_tree(model_dir, redis_url: str, out_dir, run_id: str, **sections: dict) -> dict:
    tree = {
        "run": {"run_id": run_id, "output_dir": str(out_dir)},
        "redis": {"url": redis_url},
        "data": {"train_path": "unused.jsonl"},
        "policy": {
            "model_name": str(model_dir),
            "generation": {"backend": "transformers", "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12},
        },
        "env": {"name": "crossing", "max_turns": 2},
        "gym_gateway": {"max_concurrent_rollouts": 4, "rollout_timeout_s": 60, "reclaim_idle_s": 600},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


def load_tree(tree: dict, path: Path) -> RunConfig:
    """``tree`` written to ``path`` as YAML and loaded as the services load it."""
    path.write_text(yaml.safe_dump(tree))
    return load(RunConfig, path, env={})


@contextlib.asynccontextmanager
async def trainer_side(cfg: RunConfig, redis_url: str) -> AsyncIterator[tuple[Redis, StreamClient]]:
    """A connection and the stream client of the trainer's side of run ``cfg`` (its consumer group
    on the trajectories made); closed after."""
    redis = connect(redis_url)
    streams = StreamClient(redis, K.RunKeys(cfg.run.run_id), "test-trainer")
    await streams.ensure_group(streams.keys.trajectories, K.TRAINER_GROUP)
    try:
        yield redis, streams
    finally:
        await redis.aclose()


async def publish_v0(streams: StreamClient, model_dir: Path | str, *worker_ids: str) -> None:
    """Weights v0 announced as the trainer's initial refit does, and confirmed by ``worker_ids``."""
    ann = WeightAnnouncement(
        version=0, path=str(model_dir), checksum=checksum_dir(model_dir), num_bytes=dir_num_bytes(model_dir)
    )
    await streams.publish(streams.keys.weights, ann)
    for worker_id in worker_ids:
        ack = await wait_ack(streams, 0, worker_id=worker_id)
        assert ack.ok, ack.error


def gateway_stacks(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> Callable[..., AbstractAsyncContextManager[Stack]]:
    """Factory: ``gateway_stack(num_generators=1, drain_timeout_s=5, model_dir=None, **sections)`` where
    sections (``env={...}``, ``gym_gateway={...}``) update the run config and ``model_dir`` replaces
    the tiny model (as the policy and as weights v0)."""
    from services.generator.app import build_app as build_generator
    from services.gym_gateway.app import build_app as build_gateway

    @contextlib.asynccontextmanager
    async def _stack(num_generators: int = 1, drain_timeout_s: float = 5.0, model_dir=None, **sections: dict):
        model_dir = model_dir or tiny_model_dir
        run_id = f"gw-{uuid.uuid4().hex[:8]}"
        sections["gym_gateway"] = {"drain_timeout_s": drain_timeout_s, **sections.get("gym_gateway", {})}
        cfg = load_tree(run_tree(model_dir, redis_url, tmp_path, run_id, **sections), tmp_path / f"{run_id}.yaml")
        gens: list[_Served] = []
        async with trainer_side(cfg, redis_url) as (_, streams):
            try:
                for i in range(num_generators):
                    port = free_port()
                    gens.append(_Served(build_generator(cfg, worker_id=f"gen-{i}", port=port), port))
                    await gens[-1].start()
                await publish_v0(streams, model_dir, *(f"gen-{i}" for i in range(num_generators)))
                gw_port = free_port()
                gateway = build_gateway(cfg, worker_id="gw-0", port=gw_port)
                async with serve(gateway, gw_port) as gw_url:
                    yield Stack(cfg, gateway, streams, gw_url, gens)
            finally:
                for g in reversed(gens):
                    await g.stop()

    return _stack


def scripted_gateways(redis_url: str, tmp_path: Path) -> Callable[..., AbstractAsyncContextManager[Stack]]:
    """Factory: ``scripted_gateway(policies, **sections)`` (sections as for ``gateway_stack``)."""
    from services.gym_gateway.app import build_app as build_gateway
    from tests.support.fakes.generator import ScriptedGenerator

    @contextlib.asynccontextmanager
    async def _stack(policies: dict, **sections: dict):
        run_id = f"sg-{uuid.uuid4().hex[:8]}"
        cfg = load_tree(
            run_tree("scripted-policy", redis_url, tmp_path, run_id, **sections), tmp_path / f"{run_id}.yaml"
        )
        async with trainer_side(cfg, redis_url) as (redis, streams):
            async with ScriptedGenerator(policies).serving(serve, redis, streams.keys):
                gw_port = free_port()
                gateway = build_gateway(cfg, worker_id="gw-0", port=gw_port)
                async with serve(gateway, gw_port) as gw_url:
                    yield Stack(cfg, gateway, streams, gw_url)

    return _stack

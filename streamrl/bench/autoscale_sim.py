"""The worker processes of the autoscaling benchmark (`streamrl.bench.autoscale`), one per member
of the benchmark's worker pools, so that scaling starts and drains real processes:

* ``gateway``: one real `GatewayWorker` (tasks stream in, a session per rollout through the real
  `SessionProxy`, trajectories out) with ``gym_gateway.max_concurrent_rollouts`` slots, running
  the benchmark's `SleepEnv`; it publishes its heartbeat (busy slots) as the gateway app does, and
  at SIGTERM drains as the app does (running rollouts finish, the rest go back to the group);
* ``generator``: the pipeline benchmark's `SimGenerator` (confirms every weight version at once).

Both answer ``GET /ready`` on their port once serving, as the services do, which is what the
pool (`streamrl.worker_pool`) waits for. Entry point: ``python -m streamrl.bench.autoscale_sim
ROLE CONFIG SCENARIO PORT WORKER_ID``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from services.gym_gateway.proxy import GeneratorPool, SessionProxy
from services.gym_gateway.worker import GatewayWorker
from shared import keys as K
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect
from streamrl.bench.schedule import Scenario
from streamrl.bench.sleep_env import SleepEnv, registered_env


class SlowdownScenario(msgspec.Struct):
    """scenario.json: the scenario and from which prompt its rollouts take ``slowdown`` x longer."""

    scenario: dict[str, object]
    slowdown: float
    slowdown_from_prompt: int


async def _ready(_: web.Request) -> web.Response:
    return web.Response(text="ready")


async def _ready_server(port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/ready", _ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def serve_gateway(cfg: RunConfig, scenario: SlowdownScenario, port: int, worker_id: str) -> None:
    assert cfg.redis.url, "the benchmark writes its Redis URL into the config"
    keys, gw = K.RunKeys(cfg.run.run_id), cfg.gym_gateway
    env = SleepEnv(
        Scenario(**scenario.scenario),  # type: ignore[arg-type]
        slowdown=scenario.slowdown,
        slowdown_from_prompt=scenario.slowdown_from_prompt,
    )
    redis = connect(cfg.redis.url)
    http = aiohttp.ClientSession()
    proxy = SessionProxy(GeneratorPool(redis, keys, refresh_s=0.0), http, request_timeout_s=gw.request_timeout_s)
    url = f"http://127.0.0.1:{port}"
    worker = GatewayWorker(
        StreamClient(redis, keys, worker_id),
        proxy,
        http,
        env_cfg=cfg.env,
        session_base_url=url,
        max_concurrent=gw.max_concurrent_rollouts,
        reclaim_idle_s=gw.reclaim_idle_s,
        gateway_id=worker_id,
    )

    def heartbeat() -> Heartbeat:
        return Heartbeat(
            worker_id=worker_id,
            kind="gym_gateway",
            url=url,
            state="draining" if worker.stopping else "ready",
            in_flight=len(worker.active),
        )

    beats = HeartbeatTask(redis, keys, heartbeat)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(worker, "stopping", True))
    with registered_env(env):
        beats.start()
        runner = await _ready_server(port)
        try:
            await worker.run()
            await worker.drain(gw.drain_timeout_s)
        finally:
            await runner.cleanup()
            await beats.aclose(worker_id)
            await http.close()
            await redis.aclose()


async def serve_generator(cfg: RunConfig, port: int) -> None:
    from streamrl.bench.pipeline_sim import SimGenerator

    assert cfg.redis.url, "the benchmark writes its Redis URL into the config"
    runner = await _ready_server(port)
    try:
        await SimGenerator(cfg.redis.url, cfg.run.run_id).run()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> None:
    role, config, scenario, port, worker_id = argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = msgspec.json.decode(Path(config).read_bytes(), type=RunConfig)
    if role == "generator":
        asyncio.run(serve_generator(cfg, int(port)))
    else:
        sc = msgspec.convert(json.loads(Path(scenario).read_text()), SlowdownScenario)
        asyncio.run(serve_gateway(cfg, sc, int(port), worker_id))


if __name__ == "__main__":
    main(sys.argv[1:])

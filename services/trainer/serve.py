"""Runs the trainer: the GRPO loop and the REST API side by side on one event loop.

The REST server keeps answering while the loop trains (training runs in a worker thread). The
process exits 0 when the run finishes, 1 when it fails, and drains on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from services.trainer.app import build_app
from services.trainer.observe import TrainerMetrics
from services.trainer.runtime import TrainerRuntime
from shared.registry import default_worker_id
from shared.run_config import RunConfig

log = logging.getLogger(__name__)


async def serve(cfg: RunConfig, port: int | None = None, *, worker_id: str | None = None) -> int:
    port = cfg.trainer.port if port is None else port
    metrics = TrainerMetrics()
    runtime = TrainerRuntime(
        cfg, worker_id=worker_id or default_worker_id("trainer"), url=f"http://{cfg.trainer.host}:{port}"
    )
    app = build_app(runtime, metrics)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.trainer.host, port=port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # we handle signals ourselves
    server_task = asyncio.create_task(server.serve(), name="rest")
    metrics.start_loop_lag_probe()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    code = 1
    try:
        await runtime.start()
        await runtime.run()
        code = 0
    except asyncio.CancelledError:
        log.warning("trainer stopped by signal at step %d", runtime.step)
        code = 130
    except Exception:
        log.exception("trainer failed")
    finally:
        server.should_exit = True
        await asyncio.gather(server_task, return_exceptions=True)
        await metrics.aclose()
        if hasattr(runtime, "heartbeat"):
            await runtime.aclose()
    return code

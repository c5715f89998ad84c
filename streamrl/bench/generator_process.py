"""A vLLM generator service process for the benchmarks, and the run config it is started with.

`GeneratorProcess` starts ``python -m services.generator`` in a session of its own and stops it
with its engine processes; `generator_config` writes the demo's engine settings into a run config
tree. Used by the generator, gateway and refit sections (`streamrl.bench.generator`,
`streamrl.bench.throughput`, `streamrl.bench.gateway`, `streamrl.bench.refit_worker`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from streamrl.child_guard import guarded

if TYPE_CHECKING:
    import aiohttp

ROOT = Path(__file__).resolve().parents[2]


def generator_config(model_dir: Path, redis_url: str, run_id: str, max_new_tokens: int) -> dict[str, Any]:
    """A run config tree (YAML) for one vLLM generator on ``model_dir`` with the demo's engine
    settings."""
    from streamrl.demo import CONFIG

    demo = yaml.safe_load(CONFIG.read_text())
    return {
        "run": {"run_id": run_id, "seed": 0},
        "redis": {"url": redis_url},
        "policy": {
            "model_name": str(model_dir.resolve()),
            "generation": {
                "backend": "vllm",
                "temperature": 0.8,
                "top_p": 1.0,
                "max_new_tokens": max_new_tokens,
                "vllm_cfg": demo["policy"]["generation"]["vllm_cfg"],
            },
        },
        "generator": {"host": "127.0.0.1", "drain_timeout_s": 30.0, "weight_load_timeout_s": 60.0},
    }


class GeneratorProcess:
    """``python -m services.generator`` as a child process in its own session."""

    def __init__(self, config: Path, port: int, log_path: Path) -> None:
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "services.generator",
            "--config",
            str(config),
            "--port",
            str(port),
            "--worker-id",
            "gen-bench",
        ]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                guarded(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )  # stops with the benchmark, however the benchmark ends

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 300.0) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"generator exited with {self.proc.returncode}; see {self.log_path}")
            try:
                async with session.get(f"{self.url}/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
        raise RuntimeError(f"generator not ready within {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the process group (vLLM's engine process included)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

"""A generator scaled down (SIGTERM) drains instead of dropping its sessions: the registry shows
"draining" at once (gateways stop routing new sessions to it, the trainer stops waiting for it),
a session it already served is still answered, a new session gets 503 (its gateway fails over),
and it exits once no call came for ``generator.drain_session_idle_s``, deregistered.
The generator runs as a process with the transformers engine on the tiny model."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from shared import keys as K
from shared.protocol import Heartbeat, decode
from tests.support.services import Service

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# generator.drain_session_idle_s: the session's next turn must come within it after the last one,
# across the signal and the wait for the registry, even when a loaded machine takes seconds.
IDLE_S = 10.0


def _chat(url: str, session_id: str) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": "You are a robot at a crossing."}],
        "max_tokens": 4,
        "temperature": 0.8,
        "top_p": 1.0,
        "streamrl": {"kind": "train", "session_id": session_id},
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60.0)


def _state(r: redis.Redis, keys: K.RunKeys, worker_id: str) -> str | None:
    raw = r.hget(keys.registry_info, worker_id)
    return None if raw is None else decode(raw, Heartbeat).state


def test_a_draining_generator_serves_its_sessions_refuses_new_ones_then_exits(tmp_path, tiny_model_dir, redis_url):
    tree = yaml.safe_load((ROOT / "deploy/configs/demo.yaml").read_text())
    run_id = f"drain-{os.getpid()}"
    tree["run"].update(run_id=run_id, output_dir=str(tmp_path / "run"))
    tree["redis"] = {"url": redis_url}
    tree["policy"]["model_name"] = str(tiny_model_dir)
    tree["policy"]["generation"]["backend"] = "transformers"
    del tree["data"]  # the generator reads no dataset, so its config needs none
    tree["generator"].update(drain_session_idle_s=IDLE_S, drain_timeout_s=120)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    gen = Service("services.generator", config, "gen-d", tmp_path / "generator.log").start()
    url = gen.url
    r, keys = redis.Redis.from_url(redis_url), K.RunKeys(run_id)
    try:
        gen.wait_ready(180, poll_s=0.3)
        assert _chat(url, "s-known").status_code == 200
        gen.proc.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
        while _state(r, keys, "gen-d") != "draining":
            assert time.monotonic() - t_signal < 30, "the registry never showed the generator draining"
            time.sleep(0.05)
        known = _chat(url, "s-known")  # the rollout's next turn: still served here
        t_last = time.monotonic()
        new = _chat(url, "s-new")
        assert known.status_code == 200, known.text
        assert new.status_code == 503 and "draining" in new.text
        code = gen.proc.wait(IDLE_S + 60)
        assert code in (0, -signal.SIGTERM), gen.tail()
        assert time.monotonic() - t_last >= IDLE_S  # it waited for the session to go quiet
        assert _state(r, keys, "gen-d") is None  # deregistered
    finally:
        if gen.alive():
            gen.kill9()

"""Schema-driven fuzzing of every service's HTTP API: no request may get a 5xx.

Schemathesis reads each app's ``/openapi.json`` (request bodies described from the msgspec
Structs, `shared.openapi`) and sends generated requests, valid and invalid, to the app in-process
through its ASGI transport, with the app's lifespan running on a real backend:

* the generator with the transformers engine on the tiny model, registered in the session's Valkey;
* the gym gateway on the same Valkey, in front of that generator, with one open session so that
  the per-session routes see real session ids as well as unknown ones;
* the trainer around an opened control plane (tiny policy loaded) on the same Valkey.

Each operation gets ``FUZZ_EXAMPLES`` generated cases (``STREAMRL_FUZZ_EXAMPLES`` raises it for a
longer hunt). Only the server-error check runs: a 4xx naming the field is the expected answer to
bad input. Admin pauses are undone after each case so that later cases are not held at the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid

import httpx
import pytest
import redis
import schemathesis
import uvicorn
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi

from services.generator.app import build_app as build_generator
from services.gym_gateway.app import build_app as build_gateway
from services.gym_gateway.envs.base import Outcome
from shared import keys as K
from shared.config import load
from shared.protocol import SamplingParams, Trajectory, WeightAnnouncement, decode, encode
from shared.run_config import RunConfig
from shared.weights_format import checksum_dir, dir_num_bytes
from streamrl.redis_server import free_port
from tests.support.messages import make_task

pytestmark = pytest.mark.integration

FUZZ_EXAMPLES = int(os.environ.get("STREAMRL_FUZZ_EXAMPLES", "15"))
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
        time.sleep(0.05)


def served_schema(app, ready_path: str = "/ready"):
    """The app's schema, with its lifespan started (in schemathesis' event loop, until the end of
    the test) and ``ready_path`` answering 200."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    with asgi.get_client(app) as client:
        _wait_until(lambda: client.get(ready_path).status_code == 200, f"200 from {ready_path}")
    return schema


def _status(app, path: str) -> int:
    with asgi.get_client(app) as client:
        return client.get(path).status_code


def _check(case) -> None:
    response = case.call(timeout=60)
    if case.path == "/admin/pause":
        with asgi.get_client(case.operation.app) as client:
            client.post("/admin/resume")
    if case.path == "/ready":  # a readiness probe answers 503 by design while the service cannot work
        assert response.status_code in (200, 503), response.text
        return
    case.validate_response(response, checks=[not_a_server_error])


def fuzz(schema, *, path_parameters: dict | None = None, skip: str | None = None) -> list[str]:
    """Run every operation of ``schema`` (but those whose path contains ``skip``) with valid and
    invalid cases; the failures, one line each (operation, mode, error) after Hypothesis shrank them."""
    failures = []
    for result in schema.get_all_operations():
        op = result.ok()
        if skip and skip in op.path:
            continue
        params = {k: v for k, v in (path_parameters or {}).items() if "{" + k + "}" in op.path}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = FUZZ_SETTINGS(given(op.as_strategy(mode, path_parameters=params or None))(_check))
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid: no parameters and no body
                continue
            except Exception as exc:  # noqa: BLE001 - collected, reported together below
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc}")
    return failures


# -- generator ------------------------------------------------------------------------------------


def test_generator_api_never_answers_5xx(tiny_model_dir, redis_url, generator_config_tree, tmp_path):
    tree = generator_config_tree(
        tiny_model_dir, run_id=f"fuzz-{uuid.uuid4().hex[:8]}", redis_url=redis_url, backend="transformers"
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    app = build_generator(load(RunConfig, path, env={}), worker_id="gen-fuzz", port=0)
    schema = served_schema(app)
    body = schema.raw_schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    failures = fuzz(schema)
    ready_after = _status(app, "/ready")  # no fuzzed admin call took the generator out of service
    asgi.shutdown_lifespans()
    assert not failures, "\n\n".join(failures)
    assert ready_after == 200


# -- gym gateway ----------------------------------------------------------------------------------


class ThreadServer:
    """An ASGI app served by uvicorn on a loopback port from its own thread and event loop (the
    gateway reaches generators over real HTTP; the fuzzed app runs in schemathesis' loop)."""

    def __init__(self, build) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(build(self.port), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name="fuzz-generator", daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not (self.server.started and httpx.get(f"{self.url}/ready").status_code == 200):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not become ready")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class HoldEnv:
    """An environment whose rollout keeps its session open until released, so that fuzzed calls
    reach a live session (and are recorded into its trajectory)."""

    name = "fuzz_hold"

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.release = threading.Event()

    async def aclose(self):
        pass

    async def rollout(self, instance, llm, *, max_turns):
        self.session_id = llm.session_id
        while not self.release.is_set():
            await asyncio.sleep(0.05)
        return Outcome(reward=1.0)


def _gateway_config(tiny_model_dir, redis_url, tmp_path) -> RunConfig:
    run_id = f"fuzz-gw-{uuid.uuid4().hex[:8]}"
    tree = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path)},
        "redis": {"url": redis_url},
        "data": {"train_path": "unused.jsonl"},
        "policy": {
            "model_name": str(tiny_model_dir),
            "generation": {"backend": "transformers", "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
        },
        "env": {"name": HoldEnv.name, "max_turns": 2},
        "gym_gateway": {"max_concurrent_rollouts": 2, "rollout_timeout_s": 600, "request_timeout_s": 60},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load(RunConfig, path, env={})


def test_gateway_api_never_answers_5xx(tiny_model_dir, redis_url, tmp_path, registered_env):
    cfg = _gateway_config(tiny_model_dir, redis_url, tmp_path)
    keys, r = K.RunKeys(cfg.run.run_id), redis.Redis.from_url(redis_url)
    r.xgroup_create(keys.trajectories, K.TRAINER_GROUP, id="0", mkstream=True)
    env = HoldEnv()
    with (
        registered_env(env),
        ThreadServer(lambda port: build_generator(cfg, worker_id="gen-fuzz", port=port)) as generator,
    ):
        # weights v0, as the trainer's initial refit does: sessions go only to a generator serving a version
        r.xadd(
            keys.weights,
            {
                K.ENTRY_FIELD: encode(
                    WeightAnnouncement(
                        version=0,
                        path=str(tiny_model_dir),
                        checksum=checksum_dir(tiny_model_dir),
                        num_bytes=dir_num_bytes(tiny_model_dir),
                    )
                )
            },
        )
        _wait_until(lambda: httpx.get(f"{generator.url}/ready").json()["weight_version"] == 0, "weights v0 loaded")
        app = build_gateway(cfg, worker_id="gw-fuzz", port=0)
        schema = served_schema(app, "/ready")
        task = make_task("fuzz", env=env.name, sampling=SamplingParams(max_tokens=8), deadline_s=600)
        r.xadd(keys.tasks, {K.ENTRY_FIELD: encode(task)})
        _wait_until(lambda: env.session_id is not None, "a session opened for the task")
        # the training-token-capture paths are served by the same handlers as /ng-rollout/{session_id}/...
        same = "/training-token-capture/"
        failures = fuzz(schema, path_parameters={"session_id": env.session_id}, skip=same) + fuzz(schema, skip=same)
        env.release.set()
        _wait_until(lambda: r.xlen(keys.trajectories), "the held rollout's trajectory")
        asgi.shutdown_lifespans()
    assert not failures, "\n\n".join(failures)
    # what the fuzzed calls left in the session is still a valid trajectory
    traj = decode(r.xrange(keys.trajectories)[0][1][K.ENTRY_FIELD], Trajectory)
    assert traj.task_id == "fuzz/0" and traj.status == "ok"
    assert r.xlen(keys.deadletter) == 0


# -- trainer --------------------------------------------------------------------------------------


def test_trainer_api_never_answers_5xx(tiny_model_dir, redis_url, tmp_path):
    from tests.support.trainer import control_plane, serving_app, trainer_config

    cfg = trainer_config(tmp_path, redis_url, tiny_model_dir, "fuzz-tr")
    control = control_plane(cfg)
    app = serving_app(cfg, control)

    @contextlib.asynccontextmanager
    async def lifespan(_app):  # the control plane opens on the loop that serves the app (its Redis client)
        await control.open()
        yield
        await control.aclose()

    app.router.lifespan_context = lifespan
    schema = served_schema(app, "/status")
    failures = fuzz(schema)
    asgi.shutdown_lifespans()
    assert not failures, "\n\n".join(failures)

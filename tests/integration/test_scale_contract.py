"""The contract every `streamrl.scale.ScaleBackend` keeps, run against each backend with its test
double (local: the supervisor's scaling loop over real child processes; compose: the compose
binary against a fake Docker Engine API; k8s: the kubernetes client against a fake API server):
``counts()`` reports every service, ``scale()`` returns the counts before and after, and once it
returns ``counts()`` agrees with the targets, up and down."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from streamrl.scale import SERVICES
from streamrl.scale_compose import ComposeBackend
from streamrl.scale_k8s import KubernetesBackend
from streamrl.scale_local import LocalBackend
from tests.support.fakes.docker import FakeEngine
from tests.support.fakes.kube import FakeKubeAPI
from tests.support.scale import Rig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "compose", "k8s"])
def backend(request, tmp_path, redis_url):
    if request.param == "local":
        rig = Rig(tmp_path, redis_url)
        yield LocalBackend(tmp_path)
        rig.close()
    elif request.param == "compose":
        sock = Path("/tmp") / f"fake-docker-contract-{os.getpid()}.sock"
        fake = FakeEngine(sock)
        be = ComposeBackend(ROOT / "docker-compose.yml", project_name="contract", docker_host=fake.start())
        be.scale({"generator": 1, "gym-gateway": 1}, timeout_s=60)
        yield be
        fake.stop()
        sock.unlink(missing_ok=True)
    else:
        fake = FakeKubeAPI(token="tok", namespace="default")
        fake.add_deployment("generator", "generator", 1)
        fake.add_deployment("gym-gateway", "gym-gateway", 1)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "c",
                    "clusters": [{"name": "k", "cluster": {"server": fake.start()}}],
                    "users": [{"name": "u", "user": {"token": "tok"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                }
            )
        )
        yield KubernetesBackend(kubeconfig=str(kubeconfig))
        fake.stop()


def test_scale_up_and_down_report_and_reach_the_targets(backend):
    start = backend.counts()
    assert start == {s: 1 for s in SERVICES}
    up = backend.scale({"generator": 2}, timeout_s=60)
    assert up.before == start and up.after == {"generator": 2, "gym-gateway": 1} == backend.counts()
    down = backend.scale({"generator": 1, "gym-gateway": 1}, timeout_s=60)
    assert down.before == up.after and down.after == start == backend.counts()

"""The k8s scale backend against a fake Kubernetes API server (tests/support/fakes/kube.py) through the
real kubernetes client and a kubeconfig, checked at the HTTP level: the PATCH of each Deployment's
scale subresource (path, merge-patch body, bearer token, namespace from the kubeconfig context),
Deployments found by their labels, and a wait that ends only when the new pods are ready and the
removed ones have finished draining."""

from __future__ import annotations

import pytest
import yaml

from streamrl.scale import ScaleError
from streamrl.scale_k8s import KubernetesBackend
from tests.support.fakes.kube import FakeKubeAPI

pytestmark = pytest.mark.integration

TOKEN = "t0ken-for-the-fake"
NAMESPACE = "training"


@pytest.fixture
def api(tmp_path):
    fake = FakeKubeAPI(token=TOKEN, namespace=NAMESPACE)
    fake.add_deployment("run1-generator", "generator", 1)  # a kustomize namePrefix: found by label
    fake.add_deployment("run1-gym-gateway", "gym-gateway", 2)
    fake.add_deployment("other-app", "generator", 1, part_of="something-else")
    server = fake.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "trainer", "user": {"token": TOKEN}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "trainer", "namespace": NAMESPACE}}
                ],
            }
        )
    )
    yield fake, str(kubeconfig)
    fake.stop()


def test_scale_patches_the_scale_subresource_and_waits_for_ready_pods(api):
    fake, kubeconfig = api
    be = KubernetesBackend(kubeconfig=kubeconfig)
    assert be.namespace == NAMESPACE
    assert be.deployments == {"generator": "run1-generator", "gym-gateway": "run1-gym-gateway"}
    result = be.scale({"generator": 3}, timeout_s=30)
    assert result.describe() == "generator: 1 -> 3, gym-gateway: 2 -> 2"
    [patch] = fake.patches()
    assert patch.path == f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/run1-generator/scale"
    assert patch.content_type == "application/merge-patch+json" and patch.body == {"spec": {"replicas": 3}}
    assert patch.authorization == f"Bearer {TOKEN}"
    assert all(p.reads_left == 0 for p in fake.live_pods("run1-generator"))  # returned once all were ready
    assert be.counts() == {"generator": 3, "gym-gateway": 2}


def test_scale_down_returns_only_after_the_removed_pods_drained(api):
    fake, kubeconfig = api
    be = KubernetesBackend(kubeconfig=kubeconfig)
    be.scale({"generator": 2, "gym-gateway": 3}, timeout_s=30)
    fake.calls.clear()
    result = be.scale({"generator": 1, "gym-gateway": 1}, timeout_s=30)
    assert result.after == {"generator": 1, "gym-gateway": 1}
    assert [(c.path.split("/")[-2], c.body) for c in fake.patches()] == [
        ("run1-generator", {"spec": {"replicas": 1}}),
        ("run1-gym-gateway", {"spec": {"replicas": 1}}),
    ]
    for name in ("run1-generator", "run1-gym-gateway"):
        assert [p.terminating for p in fake.deployments[name].pods] == [False]  # nothing still draining


def test_deployments_can_be_named_and_ambiguity_is_an_error(api):
    fake, kubeconfig = api
    named = KubernetesBackend(kubeconfig=kubeconfig, deployments={"generator": "other-app"})
    assert named.deployments["generator"] == "other-app"
    with pytest.raises(
        ScaleError,
        match="2 Deployments .* match app.kubernetes.io/component=generator: "
        "other-app, run1-generator; name the generator one with --generator-deployment",
    ):
        KubernetesBackend(kubeconfig=kubeconfig, selector="")
    with pytest.raises(ScaleError, match="0 Deployments in namespace 'elsewhere'"):
        KubernetesBackend(kubeconfig=kubeconfig, namespace="elsewhere")


def test_pods_that_never_get_ready_fail_by_name_at_the_deadline(api):
    fake, kubeconfig = api
    fake.never_ready = True
    be = KubernetesBackend(kubeconfig=kubeconfig)
    with pytest.raises(ScaleError, match="not scaled within 3s: run1-generator: 1 ready of 2 \\(want 2\\)"):
        be.scale({"generator": 2}, timeout_s=3)


def test_a_rejected_token_is_reported(api, tmp_path):
    fake, kubeconfig = api
    bad = tmp_path / "bad-kubeconfig"
    bad.write_text(open(kubeconfig).read().replace(TOKEN, "wrong"))
    with pytest.raises(ScaleError, match="401 Unauthorized"):
        KubernetesBackend(kubeconfig=str(bad))

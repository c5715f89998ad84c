"""The k8s scale backend against a fake Kubernetes API server (tests/support/fakes/kube.py) through the
real kubernetes client and a kubeconfig, checked at the HTTP level: the PATCH of each workload's
scale subresource (path, merge-patch body, bearer token, namespace from the kubeconfig context) for
Deployments and for LeaderWorkerSets (multi-node engines: a replica is a group of pods), workloads
found by their labels (with or without the LWS CRD installed) or by name, and a wait that ends only
when the new pods are ready and the removed ones have finished draining."""

from __future__ import annotations

import pytest
import yaml

from streamrl.scale import ScaleError
from streamrl.scale_k8s import KubernetesBackend
from tests.support.fakes.kube import FakeKubeAPI
from tests.support.k8s_schemas import crd_problems

pytestmark = pytest.mark.integration

TOKEN = "t0ken-for-the-fake"
NAMESPACE = "training"


def _start(fake: FakeKubeAPI, tmp_path) -> str:
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
    return str(kubeconfig)


@pytest.fixture
def api(tmp_path):
    fake = FakeKubeAPI(token=TOKEN, namespace=NAMESPACE)
    fake.add_deployment("run1-generator", "generator", 1)  # a kustomize namePrefix: found by label
    fake.add_deployment("run1-gym-gateway", "gym-gateway", 2)
    fake.add_deployment("other-app", "generator", 1, part_of="something-else")
    yield fake, _start(fake, tmp_path)
    fake.stop()


@pytest.fixture
def lws_api(tmp_path):
    """The multi-node overlay's shape: generators as a LeaderWorkerSet of 2-pod groups."""
    fake = FakeKubeAPI(token=TOKEN, namespace=NAMESPACE)
    fake.add_leaderworkerset("generator", "generator", 1, size=2)
    fake.add_deployment("gym-gateway", "gym-gateway", 8)
    yield fake, _start(fake, tmp_path)
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
        assert [p.terminating for p in fake.workloads[name].pods] == [False]  # nothing still draining


def test_deployments_can_be_named_and_ambiguity_is_an_error(api):
    fake, kubeconfig = api
    named = KubernetesBackend(kubeconfig=kubeconfig, deployments={"generator": "other-app"})
    assert named.deployments["generator"] == "other-app"
    with pytest.raises(
        ScaleError,
        match="2 Deployments or LeaderWorkerSets .* match app.kubernetes.io/component=generator: "
        "other-app, run1-generator; name the generator one with --generator-deployment",
    ):
        KubernetesBackend(kubeconfig=kubeconfig, selector="")
    with pytest.raises(ScaleError, match="0 Deployments or LeaderWorkerSets in namespace 'elsewhere'"):
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


LWS_PATH = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets"


def test_a_leaderworkerset_is_scaled_by_groups_through_its_scale_subresource(lws_api):
    fake, kubeconfig = lws_api
    be = KubernetesBackend(kubeconfig=kubeconfig)
    assert be.kinds == {"generator": "LeaderWorkerSet", "gym-gateway": "Deployment"}
    assert be.counts() == {"generator": 1, "gym-gateway": 8}
    up = be.scale({"generator": 3}, timeout_s=30)
    assert up.describe() == "generator: 1 -> 3, gym-gateway: 8 -> 8"
    [patch] = fake.patches()
    assert patch.path == f"{LWS_PATH}/generator/scale"
    assert patch.content_type == "application/merge-patch+json" and patch.body == {"spec": {"replicas": 3}}
    pods = fake.live_pods("generator")  # three groups of a leader and a worker, all ready at return
    assert [p.name for p in pods] == [
        "generator-0",
        "generator-0-1",
        "generator-1",
        "generator-1-1",
        "generator-2",
        "generator-2-1",
    ]
    assert all(p.reads_left == 0 for p in pods)
    fake.calls.clear()
    down = be.scale({"generator": 1}, timeout_s=30)
    assert down.after == {"generator": 1, "gym-gateway": 8} == be.counts()
    assert [p.name for p in fake.workloads["generator"].pods] == ["generator-0", "generator-0-1"]  # drained, gone
    pod_lists = [c for c in fake.calls if c.path.endswith("/pods")]
    assert pod_lists and all(
        c.query["labelSelector"] == "leaderworkerset.sigs.k8s.io/name=generator" for c in pod_lists
    )


def test_groups_that_never_get_ready_fail_by_name(lws_api):
    fake, kubeconfig = lws_api
    fake.never_ready = True
    be = KubernetesBackend(kubeconfig=kubeconfig)
    with pytest.raises(ScaleError, match=r"not scaled within 3s: generator: 1 ready of 2 group\(s\) \(want 2\)"):
        be.scale({"generator": 2}, timeout_s=3)


def test_the_fake_leaderworkerset_is_shaped_as_the_crd_says(lws_api):
    _, kubeconfig = lws_api
    be = KubernetesBackend(kubeconfig=kubeconfig)
    obj = be.custom.get_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", NAMESPACE, "leaderworkersets", "generator"
    )
    assert crd_problems(obj) == []


def test_without_the_lws_crd_only_deployments_are_found(tmp_path):
    fake = FakeKubeAPI(token=TOKEN, namespace=NAMESPACE, lws_crd=False)
    fake.add_deployment("generator", "generator", 1)
    fake.add_deployment("gym-gateway", "gym-gateway", 1)
    try:
        be = KubernetesBackend(kubeconfig=_start(fake, tmp_path))
        assert be.kinds == {"generator": "Deployment", "gym-gateway": "Deployment"}
        assert any(c.path == LWS_PATH for c in fake.calls)  # asked, answered 404, taken as none
        be.scale({"generator": 2}, timeout_s=30)
        assert be.counts() == {"generator": 2, "gym-gateway": 1}
    finally:
        fake.stop()


def test_workloads_can_be_named_with_their_kind(lws_api):
    fake, kubeconfig = lws_api
    fake.add_deployment("gen-b", "generator", 1)  # two workloads with the generator's label now
    with pytest.raises(ScaleError, match="2 Deployments or LeaderWorkerSets .*: gen-b, leaderworkerset/generator"):
        KubernetesBackend(kubeconfig=kubeconfig)
    plain = KubernetesBackend(kubeconfig=kubeconfig, deployments={"generator": "generator"})
    assert plain.kinds["generator"] == "LeaderWorkerSet"  # no Deployment of that name: the LWS
    typed = KubernetesBackend(kubeconfig=kubeconfig, deployments={"generator": "leaderworkerset/generator"})
    assert (typed.kinds["generator"], typed.deployments["generator"]) == ("LeaderWorkerSet", "generator")
    with pytest.raises(ScaleError, match="no Deployment or LeaderWorkerSet 'nothing' in namespace 'training'"):
        KubernetesBackend(kubeconfig=kubeconfig, deployments={"generator": "nothing"})
    with pytest.raises(ScaleError, match="name a workload as NAME, deployment/NAME or leaderworkerset/NAME"):
        KubernetesBackend(kubeconfig=kubeconfig, deployments={"generator": "statefulset/x"})

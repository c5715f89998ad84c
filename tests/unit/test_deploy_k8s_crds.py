"""The custom resources of deploy/k8s (JobSet, LeaderWorkerSet, KEDA's ScaledObject and
TriggerAuthentication) against their CRDs' published OpenAPI schemas, kept unedited in
deploy/k8s/crds: the files are the published ones (git blob ids in its README), every custom kind an
overlay renders has its CRD, the structural-schema rules are applied as the API server applies them
(tests/support/k8s_schemas.py), and a broken copy of each kind fails: an unknown field, a wrong
type, a missing required field, a violated CEL rule, a pod template the Kubernetes version rejects."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest

from tests.support.deploy import ROOT
from tests.support.k8s_pods import render
from tests.support.k8s_schemas import (
    CRD_DIR,
    K8S_VERSION,
    crd_problems,
    crds,
    git_blob_id,
    strict,
    validator,
)

pytestmark = pytest.mark.unit
CUSTOM_KINDS = {"JobSet", "LeaderWorkerSet", "ScaledObject", "TriggerAuthentication"}
README_ROW = re.compile(
    r"^\| `(?P<file>[^`]+)` \| (?P<repo>[\w.-]+/[\w.-]+) \| `(?P<path>[^`]+)` \| (?P<tag>v[\d.]+) \| "
    r"`(?P<commit>[0-9a-f]{40})` \| `(?P<blob>[0-9a-f]{40})` \|$"
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    return {o["kind"]: o for o in render(ROOT / "deploy/k8s/overlays/multi-node")}


def test_the_crds_are_the_published_files_named_in_the_readme():
    rows = {m["file"]: m for m in map(README_ROW.match, (CRD_DIR / "README.md").read_text().splitlines()) if m}
    files = sorted(p.name for p in CRD_DIR.glob("*.yaml"))
    assert files and sorted(rows) == files
    for name, row in rows.items():
        assert git_blob_id((CRD_DIR / name).read_bytes()) == row["blob"], f"{name} differs from {row['repo']}"
        assert row["path"].endswith(name)
    assert {crd.kind for crd in crds().values()} == CUSTOM_KINDS


def test_every_custom_kind_an_overlay_renders_has_its_crd():
    for overlay in sorted((ROOT / "deploy/k8s/overlays").glob("*/kustomization.yaml")):
        custom = set()
        for obj in render(overlay.parent):
            try:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert (obj["apiVersion"], obj["kind"]) in crds(), f"{overlay.parent.name}: {obj['kind']} has no CRD"
                custom.add(obj["kind"])
        assert custom == (CUSTOM_KINDS if overlay.parent.name == "multi-node" else set())


def _path(path: str) -> list[str | int]:
    """``a.0.b`` -> ["a", 0, "b"]; a key with a dot is written with ``\\.``."""
    return [int(p) if p.isdigit() else p.replace("\0", ".") for p in path.replace("\\.", "\0").split(".")]


def _set(path: str, value):
    *parents, last = _path(path)
    return lambda obj: _walk(obj, parents).__setitem__(last, value)


def _delete(path: str):
    *parents, last = _path(path)
    return lambda obj: _walk(obj, parents).__delitem__(last)


def _walk(node, keys):
    for k in keys:
        node = node[k]
    return node


POD = "spec.replicatedJobs.0.template.spec.template.spec"
BROKEN = [
    ("JobSet", _set("spec.replicatedJobs.0.replica", 1), "'replica' was unexpected"),
    ("JobSet", _set("spec.failurePolicy.maxRestarts", "3"), "'3' is not of type 'integer'"),
    ("JobSet", _delete("spec.replicatedJobs.0.template"), "'template' is a required property"),
    ("JobSet", _set(POD + ".containers.0.imagePullPolicyy", "Always"), "'imagePullPolicyy' was unexpected"),
    ("JobSet", _set(POD + ".hostnameOverride", "x"), "(as a Job): Additional properties"),  # newer than 1.32
    ("JobSet", _set(POD + ".containers.0.resources.limits.nvidia\\.com/gpu", 4.5), "not an integer or a string"),
    ("JobSet", _set("metadata.labelz", {}), "metadata: Additional properties"),
    ("LeaderWorkerSet", _set("spec.leaderWorkerTemplate.sizee", 2), "'sizee' was unexpected"),
    ("LeaderWorkerSet", _set("spec.replicas", "24"), "'24' is not of type 'integer'"),
    ("LeaderWorkerSet", _delete("spec.leaderWorkerTemplate.workerTemplate"), "'workerTemplate' is a required property"),
    ("LeaderWorkerSet", _set("spec.leaderWorkerTemplate.restartPolicy", "Always"), "is not one of"),
    (
        "LeaderWorkerSet",
        _set("spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.ports", [{}]),
        "containerPort",
    ),
    ("ScaledObject", _set("spec.scaleTargetRef.namespace", "x"), "'namespace' was unexpected"),
    ("ScaledObject", _set("spec.minReplicaCount", "8"), "'8' is not of type 'integer'"),
    ("ScaledObject", _delete("spec.triggers.0.type"), "'type' is a required property"),
    ("ScaledObject", _set("spec.triggers.0.metadata.lagCount", 64), "64 is not of type 'string'"),
    ("ScaledObject", _set("spec.minReplicaCount", 17), "minReplicaCount must be less than or equal to maxReplicaCount"),
    ("TriggerAuthentication", _set("spec.secretTargetRefs", []), "'secretTargetRefs' was unexpected"),
    ("TriggerAuthentication", _set("spec.secretTargetRef", {}), "{} is not of type 'array'"),
    ("TriggerAuthentication", _delete("spec.secretTargetRef.0.key"), "'key' is a required property"),
]


@pytest.mark.parametrize("kind,edit,expected", BROKEN, ids=[f"{b[0]}:{b[2][:30]}" for b in BROKEN])
def test_a_broken_custom_resource_fails(rendered, kind, edit, expected):
    assert crd_problems(rendered[kind]) == []
    broken = copy.deepcopy(rendered[kind])
    edit(broken)
    problems = crd_problems(broken)
    assert any(expected in p for p in problems), problems


def _errors(schema: dict, instance) -> list[str]:
    return [e.message for e in validator(strict(schema)).iter_errors(instance)]


OBJ = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize(
    "schema,good,bad",
    [
        (OBJ, [{"a": "x"}, {}], [{"b": 1}, {"a": 1}]),  # named fields only: the server would prune "b"
        ({"type": "object"}, [{}], [{"b": 1}]),  # no properties, nothing preserved: everything pruned
        (
            {**OBJ, "x-kubernetes-preserve-unknown-fields": True},
            [{"b": {"anything": [1]}}, {"a": "x", "b": 1}],
            [{"a": 1}],  # a named field keeps its type
        ),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, [{"k": 1}], [{"k": "1"}]),
        (
            {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
            [1, "1", "50%"],
            [1.5, True, [], None],
        ),
        ({"type": "string", "nullable": True, "enum": ["a"]}, [None, "a"], ["b", 1]),
        ({"type": "string"}, ["a"], [None]),
        ({"type": "integer", "format": "int32"}, [2**31 - 1, -(2**31)], [2**31]),
        (
            {"type": "object", "x-kubernetes-embedded-resource": True},
            [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"a": "b"}}}],
            [
                {"kind": "Pod"},
                {"apiVersion": "v1", "kind": "Pod", "metadata": {"uid": "u"}},
                {"apiVersion": "v1", "kind": "Pod", "spec": {}},
            ],
        ),
        (
            {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["port", "protocol"],
                "items": {
                    "type": "object",
                    "properties": {"port": {"type": "integer"}, "protocol": {"type": "string", "default": "TCP"}},
                },
            },
            [[{"port": 1}, {"port": 1, "protocol": "UDP"}]],
            [[{"port": 1}, {"port": 1, "protocol": "TCP"}]],  # the same key once the default is applied
        ),
        ({"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}}, [["a", "b"]], [["a", "a"]]),
        (
            {**OBJ, "x-kubernetes-validations": [{"rule": "self.a != 'x'", "message": "not x"}]},
            [{"a": "y"}],
            [{"a": "x"}],
        ),
        (  # a transition rule compares with the object before an update: not on create
            {**OBJ, "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "immutable"}]},
            [{"a": "x"}],
            [],
        ),
    ],
)
def test_structural_schema_rules_are_applied_as_the_api_server_does(schema, good, bad):
    for instance in good:
        assert _errors(schema, instance) == [], instance
    for instance in bad:
        assert _errors(schema, instance), instance


def test_every_crd_schema_converts_to_a_valid_draft4_schema():
    for crd in crds().values():
        assert crd.validator.schema["additionalProperties"] is False
        assert crd.validator.schema["properties"]["spec"]["additionalProperties"] is False

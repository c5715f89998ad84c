"""Offline, strict validation of rendered Kubernetes objects against their schemas.

Core kinds are checked by kubernetes-validate (strict: an unknown field fails). A custom resource
(JobSet, LeaderWorkerSet, ScaledObject, TriggerAuthentication) is checked against the
``openAPIV3Schema`` of its CustomResourceDefinition as published by its project, kept unedited in
deploy/k8s/crds (sources and versions in its README), the way the API server would:

* The schema is a Kubernetes *structural* schema in OpenAPI v3.0's dialect, whose keywords keep
  JSON Schema draft 4's meaning (``exclusiveMaximum`` is a boolean there): it is validated with
  jsonschema's Draft4Validator after a conversion for the ``x-kubernetes-*`` extensions and
  ``nullable``.
* Unknown fields: the API server prunes what a structural schema does not name, so an object
  schema without ``x-kubernetes-preserve-unknown-fields: true`` gets ``additionalProperties:
  false`` here and a field it does not name is an error (a typo would otherwise vanish silently
  on apply). Under ``x-kubernetes-preserve-unknown-fields`` anything goes, as on the server.
* ``x-kubernetes-int-or-string``: an integer or a string, nothing else. ``nullable``: null also
  accepted. ``x-kubernetes-embedded-resource``: apiVersion, kind and metadata (name, generateName,
  namespace, labels, annotations) implied. ``x-kubernetes-list-type`` set / map: items, or the
  items' ``x-kubernetes-list-map-keys``, unique. ``format`` int32 / int64: in range.
* ``x-kubernetes-validations``: each CEL rule is evaluated (cel-python) with ``self`` bound to the
  value, as on create; transition rules (those with ``oldSelf``, e.g. "Value is immutable")
  compare with a previous object and do not apply to a new one.
* The object's own metadata is ObjectMeta, checked by kubernetes-validate; the pod and job
  templates a JobSet or LeaderWorkerSet embeds are checked by kubernetes-validate as the Job or
  Pod the controller will create from them (`embedded_objects`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.support.deploy import ROOT

CRD_DIR = ROOT / "deploy/k8s/crds"
K8S_VERSION = "1.32.0"
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
EMBEDDED_METADATA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}


def git_blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes (`git hash-object`), to compare with the source's."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def strict(node: dict[str, Any]) -> dict[str, Any]:
    """A structural schema node as a JSON Schema that rejects what the API server would prune."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [strict(sub) for sub in value]
        elif key != "nullable":
            out[key] = value
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        props.setdefault("metadata", EMBEDDED_METADATA)
        out["required"] = sorted({*out.get("required", []), "apiVersion", "kind"})
    if (
        node.get("type") == "object"
        and not node.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in node
    ):
        out["additionalProperties"] = False
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def _int_or_string(validator: Any, value: Any, instance: Any, schema: dict) -> Iterator[jsonschema.ValidationError]:
    if value and (isinstance(instance, bool) or not isinstance(instance, int | str)):
        yield jsonschema.ValidationError(f"{instance!r} is not an integer or a string (x-kubernetes-int-or-string)")


def _list_type(validator: Any, value: Any, instance: Any, schema: dict) -> Iterator[jsonschema.ValidationError]:
    if not isinstance(instance, list) or value not in ("set", "map"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen: set[str] = set()
    for item in instance:
        keyed = value == "map" and isinstance(item, dict)
        # a missing key takes its default (a port's protocol is TCP), as the API server applies it
        defaults = {k: schema.get("items", {}).get("properties", {}).get(k, {}).get("default") for k in keys}
        ident = json.dumps({k: item.get(k, defaults[k]) for k in keys} if keyed else item, sort_keys=True)
        if ident in seen:
            yield jsonschema.ValidationError(
                f"duplicate {ident} in a list of type {value}" + (f" keyed by {keys}" if value == "map" else "")
            )
        seen.add(ident)


@functools.cache
def _cel_program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel(validator: Any, rules: Any, instance: Any, schema: dict) -> Iterator[jsonschema.ValidationError]:
    import celpy

    for r in rules:
        if "oldSelf" in r["rule"]:
            continue  # a transition rule: no previous object on create
        try:
            ok = _cel_program(r["rule"]).evaluate({"self": celpy.json_to_cel(instance)})
        except celpy.CELEvalError as exc:
            ok = exc
        if ok is not True and str(ok) != "True":
            why = r.get("message") or f"rule {r['rule']!r} is false"
            yield jsonschema.ValidationError(f"{why} (x-kubernetes-validations: {r['rule']}; got {ok})")


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    for name, (low, high) in INT_RANGES.items():

        def in_range(instance: object, low: int = low, high: int = high) -> bool:
            return not isinstance(instance, int) or isinstance(instance, bool) or low <= instance <= high

        checker.checks(name)(in_range)
    return checker


StructuralValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    {
        "x-kubernetes-int-or-string": _int_or_string,
        "x-kubernetes-list-type": _list_type,
        "x-kubernetes-validations": _cel,
    },
)


def validator(converted: dict[str, Any]) -> Any:
    """A validator of a schema `strict` converted, with the format and extension checks."""
    StructuralValidator.check_schema(converted)
    return StructuralValidator(converted, format_checker=_format_checker())


@dataclass(frozen=True)
class Crd:
    group: str
    kind: str
    version: str
    file: Path
    schema: dict[str, Any]  # the openAPIV3Schema as published

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @functools.cached_property
    def validator(self) -> Any:
        root = strict(self.schema)
        # ObjectMeta is the API server's to validate (kubernetes-validate here), not the CRD's.
        root["properties"]["metadata"] = {"type": "object"}
        root["required"] = sorted({*root.get("required", []), "apiVersion", "kind", "metadata"})
        return validator(root)

    def cel_rules(self) -> list[tuple[str, str]]:
        """(schema path, rule) of every x-kubernetes-validations rule of the schema."""
        found: list[tuple[str, str]] = []

        def walk(node: Any, path: str) -> None:
            if not isinstance(node, dict):
                return
            found.extend((path or ".", r["rule"]) for r in node.get("x-kubernetes-validations", []))
            for name, sub in node.get("properties", {}).items():
                walk(sub, f"{path}.{name}")
            for key in ("items", "additionalProperties"):
                walk(node.get(key), f"{path}[]" if key == "items" else f"{path}{{}}")

        walk(self.schema, "")
        return found


@functools.cache
def crds() -> dict[tuple[str, str], Crd]:
    """(apiVersion, kind) -> Crd for every served version of the CRDs in deploy/k8s/crds."""
    out = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        doc = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        assert doc["kind"] == "CustomResourceDefinition", path
        spec = doc["spec"]
        for v in spec["versions"]:
            if v.get("served"):
                crd = Crd(spec["group"], spec["names"]["kind"], v["name"], path, v["schema"]["openAPIV3Schema"])
                out[(crd.api_version, crd.kind)] = crd
    return out


def _where(error: jsonschema.ValidationError) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "."


def _core(obj: dict[str, Any], what: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
        return [f"{what}: {str(exc)[:300]}"]
    return []


def embedded_objects(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) for each Job or Pod a JobSet or LeaderWorkerSet's controller makes from its
    templates, shaped as that core object (named as the first one will be)."""
    name, spec, out = obj["metadata"]["name"], obj.get("spec", {}), []
    if obj["kind"] == "JobSet":
        for i, rj in enumerate(spec.get("replicatedJobs", [])):
            t = rj.get("template", {})
            meta = {**t.get("metadata", {}), "name": f"{name}-{rj.get('name')}-0"}
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": t.get("spec")}
            out.append((f"spec.replicatedJobs[{i}].template", job))
    elif obj["kind"] == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate", {})
        for key, pod_name in (("leaderTemplate", f"{name}-0"), ("workerTemplate", f"{name}-0-1")):
            if key in lwt:
                t = lwt[key]
                meta = {**t.get("metadata", {}), "name": pod_name}
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": t.get("spec")}
                out.append((f"spec.leaderWorkerTemplate.{key}", pod))
    return out


def crd_problems(obj: dict[str, Any]) -> list[str]:
    """What the API server (with the CRD installed) and the controller's templates would reject."""
    what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    crd = crds().get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if crd is None:
        return [f"{what}: no CRD for {obj.get('apiVersion')} {obj.get('kind')} in deploy/k8s/crds"]
    errors = sorted(crd.validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    problems = [f"{what}: {_where(e)}: {e.message[:300]}" for e in errors]
    if isinstance(obj.get("metadata"), dict):  # ObjectMeta, strictly, on a core kind that has only it
        problems += _core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, f"{what} metadata")
    if not problems:
        for where, core in embedded_objects(obj):
            problems += _core(core, f"{what} {where} (as a {core['kind']})")
    return problems


def schema_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Every object, strictly: a custom resource against its CRD, any other kind with kubernetes-validate."""
    problems = []
    for obj in objs:
        if (obj.get("apiVersion"), obj.get("kind")) in crds():
            problems += crd_problems(obj)
        else:
            problems += _core(obj, f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}")
    return problems

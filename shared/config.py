"""Config loading: defaults, then a YAML file, then environment (addresses/secrets), then dotted
command-line overrides, decoded strictly into a typed tree.

Unknown keys are errors that name the key and, when one is close, the nearest known key
(``unknown config key 'grpo.num_prompt_per_step' (did you mean 'grpo.num_prompts_per_step'?)``),
in a file as in a dotted override; type errors name the key and the expected type, a bad choice
also the allowed values, and a YAML syntax error the file, line and column. The run's schema
lives in `shared.run_config`; this module only knows how to load into any msgspec Struct tree.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
import yaml

from shared.auth import redact_url
from shared.config_error import ConfigError

T = TypeVar("T")

# Only addresses and secrets come from the environment.
ENV_OVERRIDES: dict[str, str] = {
    "REDIS_URL": "redis.url",
}


def parse_override(item: str) -> tuple[list[str], Any]:
    """``grpo.async_grpo.max_trajectory_age_steps=2`` -> (['grpo', 'async_grpo', ...], 2)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from exc
    return path, value


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"config key {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{_yaml_where(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def _yaml_where(exc: yaml.YAMLError) -> str:
    """' at line L, column C: <problem>' from a PyYAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: {problem}"


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$((?:\.[^`]*)?)`)?")
_AT = re.compile(r"^(.*) - at `\$((?:[.\[][^`]*)?)`$")


def _explain(exc: msgspec.ValidationError, cls: type) -> str:
    msg = str(exc)
    m = _UNKNOWN.search(msg)
    if m:
        where = (m.group(2) or "").lstrip(".")
        key = f"{where}.{m.group(1)}" if where else m.group(1)
        near = _nearest_key(cls, key)
        return f"unknown config key {key!r}" + (f" (did you mean {near!r}?)" if near else "")
    m = _AT.match(msg)
    if m:
        key = m.group(2).lstrip(".")
        choices = _choices(cls, key) if m.group(1).startswith("Invalid enum value") else None
        allowed = f" (one of {', '.join(repr(c) for c in choices)})" if choices else ""
        return f"config key {key!r}: {m.group(1)}{allowed}"
    return f"invalid config: {msg}"


def _choices(cls: type, key: str) -> tuple[object, ...] | None:
    """The allowed values of the Literal field at dotted ``key`` of ``cls``, if it is one."""
    t = _type_at(cls, key)
    if t is None:
        return None
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    values = tuple(v for u in members if isinstance(u, mi.LiteralType) for v in u.values)
    return values or None


def _nearest_key(cls: type, key: str) -> str | None:
    """The known key of ``cls`` an unknown dotted ``key`` most likely meant: a close sibling (a
    typo), else the same name in another section (a key put in the wrong place), else the closest
    dotted key of the whole tree; None when nothing is close."""
    parent, _, name = key.rpartition(".")
    section = _type_at(cls, parent)
    siblings = [f.encode_name for f in section.fields] if isinstance(section, mi.StructType) else []
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=_SIBLING_CUTOFF)
    if close:
        return f"{parent}.{close[0]}" if parent else close[0]
    ancestors = {key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)}
    known = [k for k in _dotted_keys(mi.type_info(cls)) if k not in ancestors]
    moved = [k for k in known if k.rpartition(".")[2] == name]
    close = difflib.get_close_matches(key, moved, n=1, cutoff=0.0) or difflib.get_close_matches(
        key, known, n=1, cutoff=_TREE_CUTOFF
    )
    return close[0] if close else None


# difflib ratios: a sibling's name is short, so a typo costs more of it; over whole dotted keys
# the shared section prefix inflates every ratio, so only a near match counts.
_SIBLING_CUTOFF = 0.75
_TREE_CUTOFF = 0.8


def _type_at(cls: type, key: str) -> Any:
    """The msgspec type info at dotted ``key`` of ``cls`` ('': ``cls`` itself), metadata unwrapped;
    None when the path leaves the tree."""
    t: Any = _unwrap(mi.type_info(cls))
    for part in key.split(".") if key else ():
        field = next((f for f in getattr(t, "fields", ()) if f.encode_name == part), None)
        if not isinstance(t, mi.StructType) or field is None:
            return None
        t = _unwrap(field.type)
    return t


def _unwrap(t: Any) -> Any:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _dotted_keys(t: Any, prefix: str = "") -> list[str]:
    """Every key of the struct tree ``t``, sections and leaves, dotted."""
    keys: list[str] = []
    for f in t.fields if isinstance(t, mi.StructType) else ():
        key = f"{prefix}{f.encode_name}"
        keys.append(key)
        keys.extend(_dotted_keys(_unwrap(f.type), key + "."))
    return keys


def decode_tree(tree: Mapping[str, Any], cls: type[T]) -> T:
    try:
        return msgspec.convert(tree, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, cls)) from None


def load(
    cls: type[T],
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> T:
    """Load ``cls`` from defaults + YAML + environment + overrides. Raises ConfigError."""
    tree: dict[str, Any] = load_yaml(path) if path else {}
    environ = os.environ if env is None else env
    for var, key in ENV_OVERRIDES.items():
        if environ.get(var):
            set_path(tree, key.split("."), environ[var])
    for item in overrides:
        keypath, value = parse_override(item)
        set_path(tree, keypath, value)
    cfg = decode_tree(tree, cls)
    check = getattr(cfg, "check", None)
    if check is not None:
        check()
    return cfg


def to_yaml(cfg: msgspec.Struct) -> str:
    """The resolved tree as YAML, with the password of every URL masked (a Redis URL from REDIS_URL
    may carry one): dumps end up in logs and terminals."""

    def redact(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: redact(v) for k, v in node.items()}
        if isinstance(node, list):
            return [redact(v) for v in node]
        return redact_url(node) if isinstance(node, str) else node

    dumped: str = yaml.safe_dump(redact(msgspec.to_builtins(cfg)), sort_keys=False)
    return dumped

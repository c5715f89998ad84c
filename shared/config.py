"""Config loading: defaults, then a YAML file, then environment (addresses/secrets), then dotted
command-line overrides, decoded strictly into a typed tree.

Unknown keys are errors that name the key (``unknown config key 'grpo.num_prompt_per_step'``);
type errors name the key and the expected type. The run's schema lives in `shared.run_config`;
this module only knows how to load into any msgspec Struct tree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

T = TypeVar("T")

# Only addresses and secrets come from the environment.
ENV_OVERRIDES: dict[str, str] = {
    "REDIS_URL": "redis.url",
}


class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message names the key."""


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


def set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"config key {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def load_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$((?:\.[^`]*)?)`)?")
_AT = re.compile(r"^(.*) - at `\$((?:[.\[][^`]*)?)`$")


def _explain(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    m = _UNKNOWN.search(msg)
    if m:
        where = (m.group(2) or "").lstrip(".")
        key = f"{where}.{m.group(1)}" if where else m.group(1)
        return f"unknown config key {key!r}"
    m = _AT.match(msg)
    if m:
        return f"config key {m.group(2).lstrip('.')!r}: {m.group(1)}"
    return f"invalid config: {msg}"


def decode_tree(tree: Mapping, cls: type[T]) -> T:
    try:
        return msgspec.convert(tree, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def load(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> T:
    """Load ``cls`` from defaults + YAML + environment + overrides. Raises ConfigError."""
    tree: dict = load_yaml(path) if path else {}
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
    from shared.auth import redact_url

    def redact(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: redact(v) for k, v in node.items()}
        if isinstance(node, list):
            return [redact(v) for v in node]
        return redact_url(node) if isinstance(node, str) else node

    return yaml.safe_dump(redact(msgspec.to_builtins(cfg)), sort_keys=False)

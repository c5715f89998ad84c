"""The vLLM engine's arguments from ``policy.generation.vllm_cfg``, checked with vLLM's own types.

The section's typed keys are the ones the generator reasons about (dtype, parallel sizes, the
KV cache, ``load_format``); ``vllm_kwargs`` carries any other `AsyncEngineArgs` argument by its
name. Each of those is converted and checked by the converter vLLM's own command line uses for
it (``AsyncEngineArgs.add_cli_args``: its int/float/JSON parsers, its choices, its dataclass
validation for nested configs such as ``compilation_config``), so a new vLLM argument works
without a change here and a wrong one fails at start-up naming the key, before any engine
process starts. Keys the generator sets itself are refused with the config key that owns them.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
from typing import Any

from shared.config_error import ConfigError
from shared.run_config import RunConfig

# Engine arguments the generator derives from other config keys or fixes for correctness.
RESERVED: dict[str, str] = {
    "model": "set policy.model_name",
    "tokenizer": "set policy.tokenizer_path",
    "seed": "set run.seed",
    "logprobs_mode": "fixed to processed_logprobs: the logprobs of the distribution tokens are sampled from",
    "weight_transfer_config": "set refit.transport and refit.collective",
    "worker_extension_cls": "set by the generator (weight-transfer checksums, CPU experts packed after updates)",
    "disable_log_stats": "set by the generator",
}

_WHERE = "policy.generation.vllm_cfg.vllm_kwargs"


@functools.cache
def engine_actions() -> dict[str, argparse.Action]:
    """vLLM's command-line actions for `AsyncEngineArgs`, by argument name."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """``vllm_kwargs`` converted by vLLM's own argument types; ConfigError names a bad key."""
    vcfg = cfg.policy.generation.vllm_cfg
    actions = engine_actions()
    out: dict[str, Any] = {}
    for key, value in vcfg.vllm_kwargs.items():
        if key in RESERVED:
            raise ConfigError(f"{_WHERE}.{key}: not settable here ({RESERVED[key]})")
        action = actions.get(key)
        if action is None:
            near = difflib.get_close_matches(key, actions, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"{_WHERE}.{key}: not a vLLM engine argument{hint}")
        out[key] = convert(f"{_WHERE}.{key}", value, action)
    load = actions["load_format"]
    load_format = vcfg.initial_load_format(cfg.refit.transport)
    out["load_format"] = convert("policy.generation.vllm_cfg.load_format", load_format, load)
    return out


def convert(where: str, value: Any, action: argparse.Action) -> Any:
    """``value`` (from YAML) as vLLM's parser would produce it from the command line."""
    flag = isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0
    if flag or (action.nargs == "?" and action.const is True and isinstance(value, bool)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false, not {value!r}")
        return value
    if value is None:
        return None
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if many:
        items = value if isinstance(value, list) else [value]
        return [_one(where, item, action) for item in items]
    return _one(where, value, action)


def _one(where: str, value: Any, action: argparse.Action) -> Any:
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    convert_text = action.type if callable(action.type) else str
    try:
        result = convert_text(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError, LookupError) as exc:
        raise ConfigError(f"{where}: {value!r} is not valid: {_first_line(exc)}") from None
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(str(c) for c in action.choices if c is not None)
        raise ConfigError(f"{where}: {value!r} is not one of: {choices}")
    return result


def _first_line(exc: BaseException) -> str:
    text = f"unknown name {exc}" if isinstance(exc, LookupError) else str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def check_vllm_cfg(cfg: RunConfig) -> None:
    """Raise ConfigError for an engine argument vLLM would refuse (nothing when the generation
    backend is not vLLM)."""
    if cfg.policy.generation.backend == "vllm":
        engine_kwargs(cfg)

"""Environment registry: name -> implementation. Built-ins: ``tool_calc`` (multi-turn tool use)
and ``echo`` (single turn); drivers of external agents: ``nemo_gym`` (NeMo-Gym agent servers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from services.gym_gateway.envs.base import Environment
from services.gym_gateway.envs.crossing import CrossingEnv
from services.gym_gateway.envs.echo import EchoEnv
from services.gym_gateway.envs.guess_number import GuessNumberEnv
from services.gym_gateway.envs.nemo_gym import NemoGymEnv
from services.gym_gateway.envs.openhands import OpenHandsEnv
from services.gym_gateway.envs.swe.agent import SweEnv
from services.gym_gateway.envs.tool_calc import ToolCalcEnv

_REGISTRY: dict[str, type] = {
    "crossing": CrossingEnv,
    "tool_calc": ToolCalcEnv,
    "guess_number": GuessNumberEnv,
    "echo": EchoEnv,
    "openhands": OpenHandsEnv,
    "swe": SweEnv,
    "nemo_gym": NemoGymEnv,
}


class UnknownEnvironment(KeyError):
    pass


def get_env(name: str, env_cfg: Any = None) -> Environment:
    """The environment called ``name``; ``env_cfg`` (the run's ``env`` section) reaches classes that
    define ``from_config``."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownEnvironment(f"unknown environment {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    if env_cfg is not None and hasattr(cls, "from_config"):
        return cls.from_config(env_cfg)
    return cls()


def env_names() -> list[str]:
    return sorted(_REGISTRY)


@contextlib.contextmanager
def registered(env: Environment) -> Iterator[Environment]:
    """Make the object ``env`` resolvable by its name while the block runs (benchmarks and tests
    plug in environments this way); a name already taken is an error."""
    if env.name in _REGISTRY:
        raise RuntimeError(f"environment {env.name!r} is already registered")
    _REGISTRY[env.name] = lambda: env
    try:
        yield env
    finally:
        del _REGISTRY[env.name]

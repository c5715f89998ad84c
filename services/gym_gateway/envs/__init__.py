"""The environment registry: a task's ``env`` name -> the `Environment` that runs it.

Built-in tasks, whose loop runs in the gateway (each one a small RL task a tiny model can learn):

    crossing       look at the traffic light with a tool, then stop, wait or go (the demo's task)
    tool_calc      integer arithmetic with a calculator tool, answered in a final message
    guess_number   find a secret number with a guessing tool that answers higher or lower
    echo           repeat the user's words (one turn)

Drivers of agents and harnesses:

    swe            the built-in tool-calling SWE agent: fixes an issue in a repository; hidden
                   tests give the reward (env.swe; docker or podman when env.swe.runtime says so)
    openhands      an OpenHands SDK agent per rollout, in its own virtualenv (env.openhands)
    nemo_gym       NeMo-Gym agent servers running a dataset row each (env.nemo_gym)

`get_env` builds one with its ``from_config`` from the run's ``env`` section (the defaults when
none is given); `registered` plugs in an object under its own name for a benchmark or a test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from services.gym_gateway.envs.base import Environment
from services.gym_gateway.envs.crossing import CrossingEnv
from services.gym_gateway.envs.echo import EchoEnv
from services.gym_gateway.envs.guess_number import GuessNumberEnv
from services.gym_gateway.envs.nemo_gym import NemoGymEnv
from services.gym_gateway.envs.openhands import OpenHandsEnv
from services.gym_gateway.envs.swe.agent import SweEnv
from services.gym_gateway.envs.tool_calc import ToolCalcEnv
from shared.sections.gateway import EnvSection

_BUILT_IN: dict[str, type[Environment]] = {
    "crossing": CrossingEnv,
    "tool_calc": ToolCalcEnv,
    "guess_number": GuessNumberEnv,
    "echo": EchoEnv,
    "swe": SweEnv,
    "openhands": OpenHandsEnv,
    "nemo_gym": NemoGymEnv,
}
ENVIRONMENTS: Mapping[str, type[Environment]] = MappingProxyType(_BUILT_IN)
_PLUGGED: dict[str, Environment] = {}  # objects plugged in by `registered`, used as they are


class UnknownEnvironment(KeyError):
    pass


def get_env(name: str, env_cfg: EnvSection | None = None) -> Environment:
    """The environment called ``name``, built from ``env_cfg`` (the run's ``env`` section)."""
    plugged = _PLUGGED.get(name)
    if plugged is not None:
        return plugged
    cls = _BUILT_IN.get(name)
    if cls is None:
        known = ", ".join(sorted([*_BUILT_IN, *_PLUGGED]))
        raise UnknownEnvironment(f"unknown environment {name!r}; known: {known}")
    return cls.from_config(env_cfg if env_cfg is not None else EnvSection())


@contextlib.contextmanager
def registered(env: Environment) -> Iterator[Environment]:
    """Make the object ``env`` resolvable by its name while the block runs (benchmarks and tests
    plug in environments this way; ``from_config`` is not called); a name already taken is an error."""
    if env.name in _BUILT_IN or env.name in _PLUGGED:
        raise RuntimeError(f"environment {env.name!r} is already registered")
    _PLUGGED[env.name] = env
    try:
        yield env
    finally:
        del _PLUGGED[env.name]

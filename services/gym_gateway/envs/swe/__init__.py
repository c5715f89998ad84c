"""The SWE driver (R2E-Gym style) and its public API, which other drivers reuse.

An instance is a repository snapshot, a problem statement, hidden tests and the status each test
must reach. The agent works in a fresh copy without the original git history and without the
hidden tests; the reward is whether the hidden tests reach the expected statuses when run in a
fresh copy holding the agent's final files.

    instances = load_instances(path)                 # native folders, R2E-Gym or SWE-bench rows
    runtime = make_runtime(env_cfg.swe)              # local subprocesses, docker or podman
    async with runtime.workspace(instance) as ws:    # ws.path: the agent's copy on the host
        res = await ws.run("pytest -q", timeout_s=60)
        ...                                          # the agent edits files under ws.path
        result = await evaluate(instance, ws)        # result.reward, result.statuses

Modules: instance (rows -> Instance), runtime (workspaces, local runtime), container (docker /
podman), copies (workspace and reward copies), evaluate (test log -> reward), tools and agent
(the built-in tool-calling agent, registered as the ``swe`` environment).
"""

from services.gym_gateway.envs.swe.copies import apply_patch
from services.gym_gateway.envs.swe.evaluate import EvalResult, evaluate, parse_test_log
from services.gym_gateway.envs.swe.instance import Instance, InstanceError, instance_from_row, load_instances
from services.gym_gateway.envs.swe.runtime import CommandResult, LocalRuntime, Runtime, Workspace, make_runtime

__all__ = [
    "CommandResult",
    "EvalResult",
    "Instance",
    "InstanceError",
    "LocalRuntime",
    "Runtime",
    "Workspace",
    "apply_patch",
    "evaluate",
    "instance_from_row",
    "load_instances",
    "make_runtime",
    "parse_test_log",
]

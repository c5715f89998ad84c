"""The SWE driver's section (``env.swe``), read by `services.gym_gateway.envs.swe` (the agent,
its runtime and containers).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.sections.base import D, Section


class SweSection(Section):
    """Driver for SWE instances with hidden tests, R2E-Gym style (``env: swe`` rows)."""

    runtime: Annotated[
        Literal["local", "docker", "podman"],
        D("where agent commands and hidden tests run: local subprocesses, or a container engine's CLI"),
    ] = "local"
    image: Annotated[str, D("container image for instances whose row names no docker_image (docker/podman)")] = ""
    instances_path: Annotated[
        str,
        D(
            "folder of instance folders, or a JSON/JSONL file of rows, that task rows name by instance_id; "
            "'': the shipped set"
        ),
    ] = ""
    workspace_root: Annotated[
        str | None, D("parent folder of per-rollout workspaces; null: the system temp folder")
    ] = None
    git_init_workspace: Annotated[
        bool, D("give the agent's copy a fresh git repository with one commit (never the original history)")
    ] = True
    command_timeout_s: Annotated[float, D("deadline of one agent command; its whole process group is killed")] = 60.0
    eval_timeout_s: Annotated[float, D("deadline of the hidden test run; past it the reward is 0")] = 300.0
    max_output_chars: Annotated[int, D("characters of a command's output kept (head and tail) for the agent")] = 8000
    shell: Annotated[str, D("shell that runs every command as `<shell> -c <command>`")] = "bash"
    local_path: Annotated[
        str | None,
        D("PATH of local commands; null: the gateway Python's bin folder, then /usr/local/bin:/usr/bin:/bin"),
    ] = None
    container_workdir: Annotated[str, D("where the workspace is mounted inside the container")] = "/testbed"
    container_engine_args: Annotated[
        list[str], D("engine flags placed before `run` (e.g. podman's --runtime runc, --root, --storage-driver)")
    ] = msgspec.field(default_factory=list)
    container_ulimits: Annotated[
        list[str], D("--ulimit flags of every container (podman as root needs limits below the host's)")
    ] = msgspec.field(default_factory=lambda: ["nofile=1024:1024", "nproc=1024:1024"])
    protected_paths: Annotated[
        list[str],
        D("globs of files the reward run takes from the snapshot, not from the agent (test config, import hooks)"),
    ] = msgspec.field(
        default_factory=lambda: [
            "conftest.py",
            "*/conftest.py",
            "pytest.ini",
            "tox.ini",
            "pytest.py",
            "pytest/*",
            "_pytest/*",
            "setup.cfg",
            "pyproject.toml",
            "sitecustomize.py",
            "usercustomize.py",
            "*.pth",
            ".venv/*",
        ]
    )

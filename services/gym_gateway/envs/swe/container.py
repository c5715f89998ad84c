"""The container runtime: every command in a fresh ``docker`` or ``podman`` container.

    <engine> [engine args] run --rm --pull never --name <unique> --network none --ulimit nofile=.. --ulimit nproc=..
             -v <workspace>:<workdir> -w <workdir> <image> <shell> -c <command>

Only the workspace folder is mounted, so the hidden tests (kept on the host, outside it) are out
of the agent's reach, and there is no network. State lives in the workspace's files only: each
command starts from the image again, as R2E-Gym's ``exec_run`` calls do. At the deadline the
engine client's process group is killed and the container removed with ``<engine> rm -f``. The
engine's own failures (exit code 125, an OCI runtime that cannot create the container, a missing
CLI) raise `SandboxError`. Images are
never pulled (``--pull never``): they must exist locally (built or imported offline).
Built by ``make_runtime`` for ``env.swe.runtime: docker | podman``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import uuid
from pathlib import Path

from services.gym_gateway.envs.base import SandboxError
from services.gym_gateway.envs.swe.runtime import CommandResult, Runtime, Workspace, spawn
from shared.sections.env_swe import SweSection

ENGINE_ERROR_EXIT = 125  # docker and podman: the engine itself failed, not the command
# 126/127 are also what a shell returns for a command it cannot run, so they are the engine's only
# with its own message: the OCI runtime could not create the container (e.g. rlimits refused).
_OCI_FAILURE = re.compile(r"OCI (runtime|permission)|Error response from daemon")
_counter = itertools.count()


class ContainerRuntime(Runtime):
    def __init__(self, cfg: SweSection, engine: str) -> None:
        super().__init__(cfg)
        self.kind = engine
        self.engine = engine

    def workdir(self, path: Path) -> str:
        return self.cfg.container_workdir

    def image_for(self, ws: Workspace) -> str:
        image = ws.instance.image or self.cfg.image
        if not image:
            raise SandboxError(f"instance {ws.instance.instance_id!r} names no docker_image and env.swe.image is empty")
        return image

    def run_argv(self, ws: Workspace, cmd: str, name: str) -> list[str]:
        """The exact command line of one command's container."""
        argv = [
            self.engine,
            *self.cfg.container_engine_args,
            "run",
            "--rm",
            "--pull",
            "never",
            "--name",
            name,
            "--network",
            "none",
        ]
        for limit in self.cfg.container_ulimits:
            argv += ["--ulimit", limit]
        argv += [
            "-v",
            f"{ws.path}:{self.cfg.container_workdir}",
            "-w",
            self.cfg.container_workdir,
            "-e",
            "PYTHONDONTWRITEBYTECODE=1",
            "-e",
            "PYTHONUNBUFFERED=1",
            self.image_for(ws),
            self.cfg.shell,
            "-c",
            cmd,
        ]
        return argv

    def _cli_env(self) -> dict[str, str]:
        # The engine CLI needs its own settings (DOCKER_HOST, CONTAINER_HOST, XDG_RUNTIME_DIR);
        # the command inside the container sees only what run_argv passes.
        keep = (
            "PATH",
            "HOME",
            "DOCKER_HOST",
            "DOCKER_CONFIG",
            "DOCKER_CONTEXT",
            "CONTAINER_HOST",
            "CONTAINERS_CONF",
            "CONTAINERS_STORAGE_CONF",
            "XDG_RUNTIME_DIR",
            "TMPDIR",
        )
        return {k: os.environ[k] for k in keep if k in os.environ}

    async def exec(self, ws: Workspace, cmd: str, timeout_s: float, max_output_chars: int) -> CommandResult:
        if shutil.which(self.engine, path=self._cli_env().get("PATH")) is None:
            raise SandboxError(f"env.swe.runtime={self.engine!r}: no {self.engine!r} executable on PATH")
        name = f"streamrl-swe-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"
        env = self._cli_env()

        async def remove() -> None:
            await spawn(
                [self.engine, *self.cfg.container_engine_args, "rm", "-f", name],
                cwd=ws.path,
                env=env,
                timeout_s=30.0,
                max_output_chars=2000,
            )

        try:
            res = await spawn(
                self.run_argv(ws, cmd, name),
                cwd=ws.path,
                env=env,
                timeout_s=timeout_s,
                max_output_chars=max_output_chars,
                on_timeout=remove,
            )
        except asyncio.CancelledError:
            await asyncio.shield(remove())
            raise
        if res.exit_code == ENGINE_ERROR_EXIT or (res.exit_code in (126, 127) and _OCI_FAILURE.search(res.output)):
            raise SandboxError(f"{self.engine} could not run the command's container: {res.output[-1000:]}")
        return res


async def engine_problem(engine: str, timeout_s: float = 20.0) -> str | None:
    """Why ``engine`` cannot run containers here (no CLI, no daemon), or None when it can."""
    if shutil.which(engine) is None:
        return f"no {engine!r} executable on PATH"
    try:
        proc = await asyncio.create_subprocess_exec(
            engine, "info", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except OSError as exc:
        return f"'{engine} info' failed: {exc}"
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"'{engine} info' did not answer within {timeout_s:g}s"
    if proc.returncode != 0:
        return f"'{engine} info' exited {proc.returncode}: {out.decode(errors='replace').strip()[-300:]}"
    return None

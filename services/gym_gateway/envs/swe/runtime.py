"""Runtimes: where a SWE instance's commands run. One interface, two kinds.

    runtime.workspace(instance) --> Workspace (a fresh host copy of the snapshot, no original .git,
        no hidden tests) --> ws.run(cmd, timeout_s)* --> removed on exit

* `LocalRuntime` (the default) runs ``<shell> -c <cmd>`` as a subprocess in its own session, with
  the workspace as its cwd and a scrubbed environment (a fixed PATH, a per-workspace HOME, nothing
  of the gateway's environment such as REDIS_URL or tokens). At the deadline the whole process
  group is killed, and so is anything a finished command left running in the background. It is
  not a security sandbox: a command can read any file the gateway's user can.
* `ContainerRuntime` (container.py) runs each command in a fresh ``docker``/``podman`` container
  with the workspace bind-mounted and no network.

Output is captured up to a cap, keeping its head and tail. A failure of the runtime itself (the
snapshot is missing, a process cannot start, the engine errs) raises `SandboxError`; a command
that fails is just a result with its exit code. Owned by the SWE driver; other drivers get a
runtime from `make_runtime(swe_cfg)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from services.gym_gateway.envs.base import SandboxError
from services.gym_gateway.envs.swe.copies import copy_snapshot
from services.gym_gateway.envs.swe.instance import Instance
from shared.sections.env_swe import SweSection

_READ_GRACE_S = 2.0  # output still buffered after the process group is gone
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "swe",
    "GIT_AUTHOR_EMAIL": "swe@localhost",
    "GIT_COMMITTER_NAME": "swe",
    "GIT_COMMITTER_EMAIL": "swe@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
}


@dataclass
class CommandResult:
    exit_code: int | None  # None: killed at the deadline
    output: str  # stdout and stderr interleaved, cut to the cap (head and tail kept)
    timed_out: bool
    duration_s: float


class Workspace:
    """One copy of an instance's repository: ``path`` on the host, ``workdir`` as commands see it
    (the same folder locally, the mount point in a container)."""

    def __init__(self, runtime: Runtime, instance: Instance, path: Path, workdir: str, home: Path) -> None:
        self.runtime = runtime
        self.instance = instance
        self.path = path
        self.workdir = workdir
        self.home = home

    async def run(
        self, cmd: str, timeout_s: float | None = None, *, max_output_chars: int | None = None
    ) -> CommandResult:
        """Run ``cmd`` with the workspace as its cwd; the runtime's command timeout by default."""
        return await self.runtime.exec(
            self,
            cmd,
            timeout_s or self.runtime.cfg.command_timeout_s,
            max_output_chars or self.runtime.cfg.max_output_chars,
        )


class Runtime:
    """Workspace set-up shared by both kinds; subclasses say how a command runs."""

    kind = "base"

    def __init__(self, cfg: SweSection) -> None:
        self.cfg = cfg

    def workdir(self, path: Path) -> str:
        return str(path)

    @contextlib.asynccontextmanager
    async def workspace(self, instance: Instance, *, git_init: bool | None = None) -> AsyncIterator[Workspace]:
        """A fresh copy of the snapshot for the agent: without the original ``.git`` and without
        anything at the hidden tests' destination; optionally a new git repository with one commit."""
        async with self.scratch(instance) as (root, repo):
            await asyncio.to_thread(copy_snapshot, instance, repo)
            ws = Workspace(self, instance, repo, self.workdir(repo), root / "home")
            if self.cfg.git_init_workspace if git_init is None else git_init:
                await self._git_init(ws)
            yield ws

    @contextlib.asynccontextmanager
    async def scratch(self, instance: Instance) -> AsyncIterator[tuple[Path, Path]]:
        """A temporary folder (``root``) for one copy of ``instance`` at ``root/repo``; removed on exit."""
        if not instance.repo_dir or not Path(instance.repo_dir).is_dir():
            raise SandboxError(
                f"instance {instance.instance_id!r}: repository snapshot {instance.repo_dir!r} is not a folder"
            )
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance.instance_id)[:40]
        try:
            if self.cfg.workspace_root:
                Path(self.cfg.workspace_root).mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix=f"swe-{safe}-", dir=self.cfg.workspace_root))
            (root / "home").mkdir()
        except OSError as exc:
            raise SandboxError(
                f"cannot create a workspace under env.swe.workspace_root={self.cfg.workspace_root!r}: {exc}"
            ) from exc
        try:
            yield root, root / "repo"
        finally:
            await asyncio.to_thread(shutil.rmtree, root, True)

    async def _git_init(self, ws: Workspace) -> None:
        # On the host for every runtime kind: the image need not have git.
        script = "git init -q && git add -A && git commit -q --no-verify -m 'Initial snapshot'"
        res = await spawn(
            ["/bin/sh", "-c", script],
            cwd=ws.path,
            env={**self.local_env(ws.home), **_GIT_ENV},
            timeout_s=60.0,
            max_output_chars=4000,
        )
        if res.exit_code != 0:
            raise SandboxError(f"git init of the workspace failed ({res.exit_code}): {res.output}")

    def local_env(self, home: Path) -> dict[str, str]:
        """The whole environment of a local command: nothing is inherited from the gateway."""
        path = self.cfg.local_path or f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        return {
            "PATH": path,
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }

    async def exec(self, ws: Workspace, cmd: str, timeout_s: float, max_output_chars: int) -> CommandResult:
        raise NotImplementedError


class LocalRuntime(Runtime):
    kind = "local"

    async def exec(self, ws: Workspace, cmd: str, timeout_s: float, max_output_chars: int) -> CommandResult:
        return await spawn(
            [self.cfg.shell, "-c", cmd],
            cwd=ws.path,
            env=self.local_env(ws.home),
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
        )


def make_runtime(cfg: SweSection) -> Runtime:
    """The runtime ``env.swe.runtime`` names; a container runtime needs its engine's CLI on PATH."""
    if cfg.runtime == "local":
        return LocalRuntime(cfg)
    from services.gym_gateway.envs.swe.container import ContainerRuntime

    return ContainerRuntime(cfg, cfg.runtime)


class _Capped:
    """Keeps the first and last ``limit // 2`` bytes of a stream and counts what fell between."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > self.half:
            self.dropped += len(self.tail) - self.half
            del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        head = self.head.decode(errors="replace")
        tail = self.tail.decode(errors="replace")
        if self.dropped:
            return f"{head}\n[... {self.dropped} bytes of output cut ...]\n{tail}"
        return head + tail


async def _read_all(stream: asyncio.StreamReader, buf: _Capped) -> None:
    while chunk := await stream.read(65536):
        buf.add(chunk)


async def _exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Whether ``proc`` exits within ``timeout_s``. Polled: ``proc.wait()`` also waits until its
    output pipe closes, which a background process holding the pipe would delay to the deadline."""
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while proc.returncode is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def spawn(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout_s: float,
    max_output_chars: int,
    on_timeout: Callable[[], Awaitable[None]] | None = None,
) -> CommandResult:
    """Run ``argv`` in a new session; kill its process group at the deadline, on cancellation and
    once it exits (background leftovers). ``on_timeout`` is awaited after a deadline kill."""
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        raise SandboxError(f"cannot start {argv[0]!r} in {cwd}: {exc}") from exc
    buf = _Capped(max_output_chars)
    assert proc.stdout is not None  # stdout=PIPE
    reader = asyncio.create_task(_read_all(proc.stdout, buf))
    try:
        timed_out = not await _exited(proc, timeout_s)
    finally:
        kill_group(proc.pid)
        await _exited(proc, _READ_GRACE_S)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(reader, _READ_GRACE_S)
    if timed_out and on_timeout is not None:
        await on_timeout()
    out = buf.text()
    if timed_out:
        out += f"\n[killed: the command ran past its {timeout_s:g}s limit]"
    return CommandResult(None if timed_out else proc.returncode, out, timed_out, time.monotonic() - started)

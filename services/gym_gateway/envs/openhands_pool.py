"""Warm OpenHands runners: the SDK imported once per runner process, not once per rollout.

Importing the OpenHands SDK costs about 10 s of CPU, which a one-shot runner pays before every
episode's first model call. With ``env.openhands.warm_runners: N`` the driver keeps N
``openhands_runner.py --serve`` processes in the SDK's virtualenv; each has imported the SDK and
forks a child per episode (the protocol is in the runner's docstring). The child is what a
one-shot runner was: its own working folder, scrubbed environment with its own HOME and tmux
socket folder, its own log and its own process group, which the driver kills at the deadline.

A runner that dies (killed, out of memory) fails the episodes it was running as ``sandbox``
failures, their process groups killed, and is replaced at the next episode. A runner that
cannot start (no interpreter, no SDK) fails the episode that wanted it, with its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.gym_gateway.envs.base import SandboxError

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0  # importing the SDK on a loaded machine; the rollout deadline still bounds it
_LOG_TAIL_CHARS = 3000


def runner_start_error(python: Path, exc: OSError) -> SandboxError:
    """The error of a runner that could not start (its interpreter is missing or not runnable)."""
    return SandboxError(
        f"OpenHands runner could not start with env.openhands.python = {python} ({exc}); run scripts/setup_openhands.sh"
    )


class PooledEpisode:
    """One episode in a warm runner's forked child; ``pid`` is also its process group. Shaped like
    ``asyncio.subprocess.Process`` where the driver uses it (``pid``, ``returncode``, ``wait``)."""

    def __init__(self, runner: WarmRunner, rid: str) -> None:
        self.runner = runner
        self.rid = rid
        self.pid = 0
        self.returncode: int | None = None
        self.started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        """The child's exit status; a `SandboxError` when its runner died first."""
        self.returncode = await asyncio.shield(self.ended)
        return self.returncode


class WarmRunner:
    """One ``--serve`` process and the episodes it runs, matched to its answers by request id."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.episodes: dict[str, PooledEpisode] = {}
        self.ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(_seen)
        self.reader = asyncio.create_task(self._read())

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self.reader.done()

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # stray output; the protocol is JSON lines only
                if "ready" in msg and not self.ready.done():
                    self.ready.set_result(int(msg["ready"]))
                ep = self.episodes.get(str(msg.get("id")))
                if ep is None:
                    continue
                if "pid" in msg and not ep.started.done():
                    ep.pid = int(msg["pid"])
                    ep.started.set_result(ep.pid)
                if "exit" in msg:
                    self.episodes.pop(ep.rid, None)
                    if not ep.ended.done():
                        ep.ended.set_result(int(msg["exit"]))
        finally:
            await self._died()

    async def _died(self) -> None:
        """Its stdout closed: it is gone (or going). Fail what waits on it, and kill the groups of
        its episodes, which would otherwise run on with nobody to report their end."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        code = await self.proc.wait()
        error = SandboxError(f"warm OpenHands runner exited with {code}: {log_tail(self.log_path)}")
        if not self.ready.done():
            self.ready.set_exception(error)
        for ep in self.episodes.values():
            if ep.pid:
                kill_group(ep.pid)
            for fut in (ep.started, ep.ended):
                if not fut.done():
                    fut.set_exception(error)
        self.episodes.clear()

    async def start(self, req: dict[str, Any]) -> PooledEpisode:
        assert self.proc.stdin is not None
        rid = str(req["id"])
        ep = self.episodes[rid] = PooledEpisode(self, rid)
        ep.started.add_done_callback(_seen)
        ep.ended.add_done_callback(_seen)
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            await self.proc.stdin.drain()
            await asyncio.shield(ep.started)
        except (ConnectionError, BrokenPipeError) as exc:
            self.episodes.pop(rid, None)
            raise SandboxError(f"warm OpenHands runner is gone ({exc}): {log_tail(self.log_path)}") from exc
        except asyncio.CancelledError:
            ep.started.add_done_callback(_kill_when_started)  # cancelled before its pid came back
            raise
        return ep

    async def stop(self) -> None:
        for ep in list(self.episodes.values()):
            if ep.pid:
                kill_group(ep.pid)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await asyncio.gather(self.reader, return_exceptions=True)


class RunnerPool:
    """``size`` warm runners of ``python runner --serve tools``, started on first use and
    replaced when they die; an episode goes to the live runner with the fewest running."""

    def __init__(
        self,
        python: Path,
        runner: Path,
        tools: list[str],
        size: int,
        make_env: Callable[[Path, Path], dict[str, str]],
        root: str | None,
    ) -> None:
        self.python, self.runner, self.tools, self.size = python, runner, list(tools), size
        self.make_env = make_env  # (HOME, tmux folder) -> a runner's scrubbed environment
        self.root = root
        self.runners: list[WarmRunner] = []
        self.started = 0  # runners started over the pool's life (replacements included)
        self._dir: Path | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.runners if r.alive]

    async def start_episode(
        self, *, job: Path, result: Path, log_path: Path, cwd: Path, env: dict[str, str]
    ) -> PooledEpisode:
        """Hand the episode to a warm runner; returns once its child runs (its pid known)."""
        runner = await self._runner()
        req = {
            "id": str(next(self._ids)),
            "job": str(job),
            "result": str(result),
            "log": str(log_path),
            "cwd": str(cwd),
            "env": env,
        }
        return await runner.start(req)

    async def _runner(self) -> WarmRunner:
        async with self._lock:
            self.runners = [r for r in self.runners if r.alive]
            missing = self.size - len(self.runners)
            if missing > 0:
                started = await asyncio.gather(*[self._spawn() for _ in range(missing)], return_exceptions=True)
                self.runners += [r for r in started if isinstance(r, WarmRunner)]
                errors = [e for e in started if isinstance(e, BaseException)]
                if not self.runners and errors:
                    raise errors[0]
        return min(self.runners, key=lambda r: len(r.episodes))

    async def _spawn(self) -> WarmRunner:
        if self._dir is None:
            root = Path(self.root).resolve() if self.root else None
            if root:
                root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="ohrunners-", dir=root))
        n = self.started
        self.started += 1
        home = self._dir / f"runner{n}"
        home.mkdir()
        log_path = self._dir / f"runner{n}.log"
        env = self.make_env(home, home / "tmux")
        with open(log_path, "wb") as out:
            try:
                proc = await asyncio.create_subprocess_exec(
                    str(self.python),
                    str(self.runner),
                    "--serve",
                    *self.tools,
                    cwd=str(home),
                    env=env,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=out,
                    start_new_session=True,
                )
            except OSError as exc:
                raise runner_start_error(self.python, exc) from exc
        runner = WarmRunner(proc, log_path)
        try:
            await asyncio.wait_for(asyncio.shield(runner.ready), READY_TIMEOUT_S)
        except BaseException:
            await runner.stop()
            raise
        log.info("warm OpenHands runner %d ready (pid %d)", n, proc.pid)
        return runner

    async def aclose(self) -> None:
        """Stop every runner and its episodes; remove the runners' folder."""
        runners, self.runners = self.runners, []
        await asyncio.gather(*[r.stop() for r in runners], return_exceptions=True)
        if self._dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._dir, True)
            self._dir = None


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _kill_when_started(fut: asyncio.Future[int]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        kill_group(fut.result())


def _seen(fut: asyncio.Future[int]) -> None:
    """Mark a failed future's error as read (asyncio logs unread ones); its waiter, if any, gets it."""
    if not fut.cancelled():
        fut.exception()


def log_tail(path: Path) -> str:
    """The end of a runner's log, for the error that names why it failed."""
    try:
        text = path.read_bytes()[-_LOG_TAIL_CHARS:].decode(errors="replace")
    except OSError:
        return "(no log)"
    return text.strip() or "(empty log)"

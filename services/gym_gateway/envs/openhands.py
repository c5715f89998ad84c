"""The OpenHands driver: one rollout is one OpenHands SDK agent episode in a local workspace.

    task instance -> workspace (template folder + files, or a SWE instance's copy)
      -> job.json -> <env.openhands.python> openhands_runner.py job.json result.json
           (own process group; LiteLLM -> the session's URL, task sampling on every call)
      -> result.json {status, iterations, actions, error_kind}
      -> reward from the workspace: the task's check command (exit 0: 1.0), or SWE's hidden tests

The SDK needs Python >= 3.12 and its own dependencies, so it runs in its own virtualenv
(``scripts/setup_openhands.sh``) and process; ``openhands_runner.py`` is the only code that runs
there. Being another process, the agent cannot use the gateway's in-process model client: it gets
the session's OpenAI base URL (``llm.base_url``) and its calls come back to the gateway's session
routes over HTTP. The process gets offline settings (``LITELLM_LOCAL_MODEL_COST_MAP=True``, no telemetry), a
scrubbed environment, its own HOME and tmux socket folder. When the rollout is cancelled (its
deadline) or ``env.openhands.timeout_s`` passes, the whole process group is killed, then every
tmux server with a socket in the job's socket folder (tmux daemonises out of the group).
With ``env.openhands.warm_runners`` > 0 the episode runs instead in a child forked by a warm
runner that imported the SDK once (``openhands_pool.py``), with the same isolation.

Task instances (``env: openhands`` rows):
  * ``prompt`` (the user message), ``check`` (a shell command run in the workspace afterwards),
    optional ``template_dir`` (a folder copied into the workspace) and ``files`` ({relative path:
    text}); or
  * ``swe``: a SWE instance row (any format ``swe.instance_from_row`` reads, or
    ``{"instance_id": ...}`` from ``env.swe.instances_path``); the agent works in the SWE runtime's
    workspace and the reward is ``swe.evaluate`` (hidden tests). The agent's own commands run on
    the gateway's host in that workspace folder, also when ``env.swe.runtime`` is a container
    engine (then only the hidden tests run in a container).

Failures: the harness cannot start, crashes or writes no result -> `SandboxError`; the model
endpoint refused a call (4xx) -> `ModelRequestError`; it was unreachable -> `TransportError`.
An agent that stops without finishing (iteration cap, stuck, agent time limit) is a ``truncated``
outcome still scored from its workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from services.gym_gateway.envs.base import ModelClient, ModelRequestError, Outcome, SandboxError, TransportError
from services.gym_gateway.envs.openhands_pool import RunnerPool, kill_group, log_tail, runner_start_error
from shared.sections.env_openhands import OpenHandsSection
from shared.sections.env_swe import SweSection
from shared.sections.gateway import EnvSection

if TYPE_CHECKING:
    from services.gym_gateway.envs.swe.agent import SweEnv

RUNNER = Path(__file__).with_name("openhands_runner.py")
SOURCE_ROOT = Path(__file__).resolve().parents[3]
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "OPENHANDS_SUPPRESS_BANNER": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "SHELL", "TERM")
# No workspace path: it differs per rollout, and a group's rollouts should share one prompt.
SWE_PROMPT = (
    "The repository is the current folder. Make the smallest change to its non-test files that "
    "resolves the issue below, then finish.\n\n<issue>\n{problem}\n</issue>"
)


@dataclass
class AgentRun:
    """What the runner reported, plus whether the driver stopped it at ``timeout_s``."""

    status: str
    iterations: int
    actions: dict[str, int]
    timed_out: bool = False


class AgentProcess(Protocol):
    """An episode's process: a one-shot runner (``asyncio.subprocess.Process``) or a warm
    runner's forked child (`PooledEpisode`); ``pid`` is its process group too."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


class OpenHandsEnv:
    name = "openhands"

    def __init__(self, cfg: OpenHandsSection | None = None, swe_cfg: SweSection | None = None) -> None:
        self.cfg = cfg or OpenHandsSection()
        self.swe_cfg = swe_cfg or SweSection()
        self._swe_env: SweEnv | None = None  # built on the first SWE row
        self.pool: RunnerPool | None = None  # warm runners, started on the first rollout

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> OpenHandsEnv:
        return cls(env_cfg.openhands, env_cfg.swe)

    @property
    def python(self) -> Path:
        p = Path(self.cfg.python).expanduser()
        return p if p.is_absolute() else SOURCE_ROOT / p

    async def aclose(self) -> None:
        """Stop the warm runners (the gateway's shutdown)."""
        if self.pool is not None:
            await self.pool.aclose()

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        """Small file tasks: write the sum of two numbers into ``answer.txt``."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            out.append(
                {
                    "prompt": (
                        f"Create a file answer.txt in the current folder holding the value of {a} + {b}, then finish."
                    ),
                    "check": f'test "$(tr -d "[:space:]" < answer.txt)" = "{a + b}"',
                }
            )
        return out

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        if "swe" in instance:
            return await self._swe_rollout(instance["swe"], llm, max_turns)
        prompt, check = _require_str(instance, "prompt"), _require_str(instance, "check")
        async with self._scratch() as scratch:
            ws = scratch / "workspace"
            prepare_workspace(ws, instance)
            run = await self.run_agent(prompt, ws, llm, max_turns=max_turns, job_dir=scratch)
            passed, check_status = await run_check(check, ws, self.cfg.check_timeout_s)
        return self.outcome(run, 1.0 if passed else 0.0, {"check_exit": float(check_status)})

    async def _swe_rollout(self, row: Any, llm: ModelClient, max_turns: int) -> Outcome:
        from services.gym_gateway.envs import swe

        if not isinstance(row, dict):
            raise ValueError("an openhands row's 'swe' must be a SWE instance object")
        if self._swe_env is None:
            from services.gym_gateway.envs.swe.agent import SweEnv

            self._swe_env = SweEnv(self.swe_cfg)
        inst = self._swe_env.resolve(row)
        async with self._swe_env.runtime.workspace(inst) as ws, self._scratch() as scratch:
            prompt = SWE_PROMPT.format(problem=inst.problem_statement)
            run = await self.run_agent(prompt, Path(ws.path), llm, max_turns=max_turns, job_dir=scratch)
            result = await swe.evaluate(inst, ws)
        return self.outcome(run, result.reward, result.metrics)

    def outcome(self, run: AgentRun, reward: float, metrics: dict[str, float]) -> Outcome:
        finished = run.status == "finished" and not run.timed_out
        m = {
            "iterations": float(run.iterations),
            "agent_finished": float(finished),
            "agent_stuck": float(run.status == "stuck"),
            "agent_timed_out": float(run.timed_out),
            "tool_calls": float(sum(run.actions.values())),
            **metrics,
        }
        return Outcome(
            reward=reward,
            status="ok" if finished else "truncated",
            metrics=m,
            mask_sample=self.cfg.mask_truncated and not finished,
        )

    @contextlib.asynccontextmanager
    async def _scratch(self) -> AsyncIterator[Path]:
        # absolute: the runner's paths are read from inside the workspace
        root = Path(self.cfg.workspace_root).resolve() if self.cfg.workspace_root else None
        if root:
            root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="openhands-", dir=root))
        try:
            yield path
        finally:
            await asyncio.to_thread(shutil.rmtree, path, True)

    # -- the agent process -----------------------------------------------------------------------

    def job(self, prompt: str, workspace: Path, llm: ModelClient, *, max_turns: int) -> dict[str, Any]:
        """The runner's job for one episode (see openhands_runner.py)."""
        if llm.sampling is None:
            raise ValueError("the openhands driver needs the task's sampling profile on its chat client")
        s = llm.sampling
        c = self.cfg
        return {
            "base_url": llm.base_url,
            "model": c.model_name,
            "api_key": "streamrl",
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens},
            "prompt": prompt,
            "workspace": str(workspace),
            "max_iterations": c.max_iterations if c.max_iterations is not None else max_turns,
            "tools": list(c.tools),
            "default_tools": list(c.default_tools),
            "terminal_type": c.terminal_type,
            "native_tool_calling": c.native_tool_calling,
            "system_prompt": c.system_prompt,
            "llm_timeout_s": c.llm_timeout_s,
            "num_retries": c.num_retries,
        }

    async def run_agent(
        self, prompt: str, workspace: Path, llm: ModelClient, *, max_turns: int, job_dir: Path
    ) -> AgentRun:
        """Run the runner on ``prompt`` in ``workspace``; its files go to ``job_dir``."""
        job_path, result_path, log_path = job_dir / "job.json", job_dir / "result.json", job_dir / "runner.log"
        job_path.write_text(json.dumps(self.job(prompt, workspace, llm, max_turns=max_turns)))
        home = job_dir / "home"
        home.mkdir(exist_ok=True)
        # A short socket folder: past 107 bytes of socket path the SDK's tmux falls back to a shared
        # one, where `stop_tmux` would not find the job's servers (a deep workspace_root does it).
        tmux_dir = Path(tempfile.mkdtemp(prefix="ohtmux-"))
        env = runner_env(home, tmux_dir)
        timed_out = False
        try:
            proc = await self._start(job_path, result_path, log_path, workspace, env)
            try:
                await asyncio.wait_for(proc.wait(), self.cfg.timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                # Cancelled (the rollout's deadline), timed out or done: nothing of the agent outlives it.
                kill_group(proc.pid)
                await asyncio.shield(stop_tmux(env))
                with contextlib.suppress(ProcessLookupError, SandboxError):  # a dead warm runner: raised above
                    await proc.wait()
        finally:
            shutil.rmtree(tmux_dir, ignore_errors=True)
        if timed_out:
            return AgentRun(
                status="timeout", iterations=_read_result(result_path).get("iterations", 0), actions={}, timed_out=True
            )
        return parse_result(_read_result(result_path), proc.returncode, log_path)

    async def _start(
        self, job_path: Path, result_path: Path, log_path: Path, workspace: Path, env: dict[str, str]
    ) -> AgentProcess:
        """The episode's process: a child of a warm runner, or a one-shot runner of its own."""
        if self.cfg.warm_runners > 0:
            if self.pool is None:
                self.pool = RunnerPool(
                    self.python,
                    RUNNER,
                    self.cfg.tools,
                    self.cfg.warm_runners,
                    runner_env,
                    self.cfg.workspace_root,
                )
            return await self.pool.start_episode(
                job=job_path, result=result_path, log_path=log_path, cwd=workspace, env=env
            )
        with open(log_path, "wb") as log:
            try:
                return await asyncio.create_subprocess_exec(
                    str(self.python),
                    str(RUNNER),
                    str(job_path),
                    str(result_path),
                    cwd=str(workspace),
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise runner_start_error(self.python, exc) from exc


def prepare_workspace(ws: Path, instance: dict[str, Any]) -> None:
    """The workspace of a plain task: ``template_dir`` copied, then ``files`` written."""
    template = instance.get("template_dir")
    if template is not None:
        src = Path(_require_str(instance, "template_dir")).expanduser()
        if not src.is_dir():
            raise ValueError(f"task instance template_dir {str(src)!r} is not a folder")
        try:
            shutil.copytree(src, ws, symlinks=True)
        except OSError as exc:
            raise SandboxError(f"could not copy template_dir {src} into the workspace: {exc}") from exc
    ws.mkdir(parents=True, exist_ok=True)
    files = instance.get("files", {})
    if not isinstance(files, dict):
        raise ValueError("task instance files must be an object {relative path: text}")
    for rel, text in files.items():
        parts = PurePosixPath(rel).parts
        if not isinstance(text, str) or not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ValueError(f"task instance files[{rel!r}] must be text at a relative path inside the workspace")
        target = ws.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


async def run_check(command: str, workspace: Path, timeout_s: float) -> tuple[bool, int]:
    """(passed, exit status) of the task's check command; -1 when it ran past ``timeout_s``."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            command,
            cwd=str(workspace),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        raise SandboxError(f"check command could not start: {exc}") from exc
    try:
        code = await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        code = -1
    finally:
        kill_group(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
    return code == 0, code


def parse_result(result: dict[str, Any], returncode: int | None, log_path: Path) -> AgentRun:
    """The runner's result as an `AgentRun`, or the error it stands for."""
    if returncode != 0 or not result:
        raise SandboxError(
            f"OpenHands runner exited with {returncode} and {'a result' if result else 'no result'}: "
            f"{log_tail(log_path)}"
        )
    kind, error = result.get("error_kind"), result.get("error")
    if kind == "model_refused":
        raise ModelRequestError(f"OpenHands agent: the model refused a call: {error}")
    if kind == "transport":
        raise TransportError(f"OpenHands agent: the model endpoint failed: {error}")
    if kind is not None:
        raise SandboxError(f"OpenHands agent failed ({kind}): {error}")
    try:
        return AgentRun(
            status=str(result["status"]),
            iterations=int(result["iterations"]),
            actions={str(k): int(v) for k, v in result.get("actions", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SandboxError(f"OpenHands runner wrote a malformed result ({exc!r}): {result}") from exc


def runner_env(home: Path, tmux_dir: Path) -> dict[str, str]:
    """The runner's environment: a few of the gateway's variables, offline settings, its own HOME
    and tmux socket folder (so its tmux server can be stopped without touching any other)."""
    tmux_dir.mkdir(exist_ok=True)
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return {**env, **OFFLINE_ENV, "HOME": str(home), "TMUX_TMPDIR": str(tmux_dir), "PYTHONUNBUFFERED": "1"}


async def stop_tmux(env: dict[str, str]) -> None:
    """Stop every tmux server with a socket in the runner's socket folder: tmux daemonises out of
    the runner's process group, and OpenHands opens one socket per terminal session."""
    tmux = shutil.which("tmux", path=env.get("PATH"))
    sockets = [p for p in Path(env["TMUX_TMPDIR"]).glob("tmux-*/*") if p.is_socket()]
    if tmux is None:
        return
    for sock in sockets:
        proc = await asyncio.create_subprocess_exec(
            tmux,
            "-S",
            str(sock),
            "kill-server",
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()


def _read_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _require_str(instance: dict[str, Any], key: str) -> str:
    value = instance.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"an openhands task instance needs a non-empty string {key!r}")
    return value

"""The OpenHands section of ``streamrl bench``: warm runners against a fresh process per rollout.

The OpenHands driver (``env: openhands``) with the real SDK in its own virtualenv, on the file
tasks of ``streamrl data make openhands`` (write the sum of two numbers into ``answer.txt``).
The model is scripted, as in the integration test's fine-tuned model: its one answer is a
terminal command and ``finish`` in the same reply, so every episode is one model call, two tool
calls, and a check; what differs between the two ways is only the runner. Both run in the same
process, round after round alternated (``ROUNDS`` each, ``ROLLOUTS`` a round, ``CONCURRENCY`` at
once), so other load on the machine hits both:

* **one process per rollout** (``env.openhands.warm_runners: 0``): the runner script is started
  for each episode and imports the SDK;
* **warm runners** (``warm_runners: CONCURRENCY``): the runners imported it once, before the
  measured rounds (their start is reported on its own), and fork a child per episode.

Reported: rollouts per minute (wall clock of the rounds), and CPU seconds per rollout: this
process (driver and scripted model, alike in both), plus its reaped children (one-shot runners,
check commands), plus the warm runners and their reaped children (``/proc``). The terminal runs
commands as the episode's own children (``terminal_type: subprocess``) so that all of an
episode's processes are counted; a tmux server would daemonise out of reach.

`openhands_benchmark` returns the section's `OpenhandsResults`, rendered by
``templates/openhands.md.jinja``. Called by `streamrl.bench.suite`. `ScriptedModel` also serves
the warm-runner integration tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from streamrl.bench.report import Results, render

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from services.gym_gateway.envs.base import ChatClient, Outcome
    from services.gym_gateway.envs.openhands import OpenHandsEnv

ROLLOUTS = 6
CONCURRENCY = 2
ROUNDS = 2
# The integration test's agent settings: a short system prompt, the terminal and finish.
OPENHANDS: dict[str, Any] = {
    "tools": ["terminal"],
    "default_tools": ["FinishTool"],
    "system_prompt": "You are a coding agent. Work in the current folder with the terminal tool, then call finish.",
    "terminal_type": "subprocess",
}
_SUM = re.compile(r"value of (\d+) \+ (\d+)")
_RUN = re.compile(r"RUN: (.+)")


class Round(msgspec.Struct):
    """One round of one way."""

    rollouts: int
    errors: int
    solved: int
    wall_s: float
    cpu_s: float  # this process, its reaped children, the warm runners and theirs
    error: str | None  # the first error's repr


class WarmStart(msgspec.Struct):
    """Starting the warm runners: importing the SDK, then one episode each."""

    wall_s: float
    runners_cpu_s: float


class Way(msgspec.Struct):
    """One way over its rounds."""

    rollouts: int
    errors: int
    solved: int
    per_min: float  # rollouts per minute of the rounds' wall clock
    per_min_rounds: list[float]
    cpu_per_rollout_s: float
    cpu_rounds: list[float]  # CPU seconds per rollout, by round
    error: str | None


class OpenhandsResults(Results):
    date: str
    machine: str
    rollouts: int  # a round
    concurrency: int
    rounds: int  # each way
    start: WarmStart
    warm: Way  # warm runners (CONCURRENCY)
    cold: Way  # one process per rollout (baseline)
    per_min_ratio: float  # warm / cold
    cpu_ratio: float


def scripted_command(prompt: str) -> str:
    """The scripted model's command for a task prompt: ``RUN: <command>`` verbatim, or the answer
    of a ``streamrl data make openhands`` task written into ``answer.txt``."""
    run = _RUN.search(prompt)
    if run:
        return run.group(1).strip()
    m = _SUM.search(prompt)
    return f"echo {int(m.group(1)) + int(m.group(2))} > answer.txt" if m else "true"


class ScriptedModel:
    """An OpenAI chat endpoint whose every answer is one terminal call (`scripted_command` of the
    first user message) and ``finish``, as native tool calls; with ``finish`` False the terminal
    call alone, so that only the turn or time limit ends the episode."""

    def __init__(self) -> None:
        self.calls = 0
        self.finish = True
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        from aiohttp import web

        from streamrl.redis_server import free_port

        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/v1"
        return self.url

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.Response:
        from aiohttp import web

        body = await request.json()
        self.calls += 1
        user: dict[str, Any] = next((m for m in body.get("messages", []) if m.get("role") == "user"), {})
        content = user.get("content", "")
        text = content if isinstance(content, str) else " ".join(str(p.get("text", "")) for p in content)
        calls: list[tuple[str, dict[str, str]]] = [("terminal", {"command": scripted_command(text)})]
        if self.finish:
            calls.append(("finish", {"message": "done"}))
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{uuid.uuid4().hex[:12]}",
                    "type": "function",
                    "function": {"name": n, "arguments": json.dumps(a)},
                }
                for n, a in calls
            ],
        }
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "policy"),
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
            }
        )


def scripted_client(url: str) -> ChatClient:
    """A chat client for the driver: it only hands the base URL and the sampling to the agent."""
    from services.gym_gateway.envs.base import ChatClient
    from shared.protocol import SamplingParams

    # The driver never calls the model itself (the agent does, over HTTP): no client session.
    http = cast("aiohttp.ClientSession", None)
    return ChatClient(url, http, timeout_s=300, sampling=SamplingParams(max_tokens=64), session_id="bench")


def _proc_cpu_s(pid: int) -> float:
    """A process's CPU time with its reaped children's (utime, stime, cutime, cstime)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu_s(env: OpenHandsEnv) -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return total + sum(_proc_cpu_s(pid) for pid in (env.pool.pids if env.pool else []))


async def _round(env: OpenHandsEnv, url: str, instances: list[dict[str, Any]]) -> Round:
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(inst: dict[str, Any]) -> Outcome | BaseException:
        async with sem:
            try:
                return await env.rollout(inst, scripted_client(url), max_turns=3)
            except Exception as exc:  # counted as an error of its way
                return exc

    cpu0, t0 = _cpu_s(env), time.perf_counter()
    outs = await asyncio.gather(*[one(i) for i in instances])
    wall, cpu = time.perf_counter() - t0, _cpu_s(env) - cpu0
    ok = [o for o in outs if not isinstance(o, BaseException)]
    error = next((repr(o) for o in outs if isinstance(o, BaseException)), None)
    return Round(len(outs), len(outs) - len(ok), sum(o.reward == 1.0 for o in ok), wall, cpu, error)


async def _run(work: Path) -> tuple[WarmStart, dict[str, list[Round]]]:
    from services.gym_gateway.envs.openhands import OpenHandsEnv
    from shared.sections.env_openhands import OpenHandsSection

    model = ScriptedModel()
    url = await model.start()
    envs = {
        "cold": OpenHandsEnv(OpenHandsSection(**OPENHANDS, workspace_root=str(work))),
        "warm": OpenHandsEnv(OpenHandsSection(**OPENHANDS, warm_runners=CONCURRENCY, workspace_root=str(work))),
    }
    tasks = envs["cold"].make_instances(ROLLOUTS * (2 * ROUNDS + 1), seed=7)
    rounds: dict[str, list[Round]] = {"cold": [], "warm": []}
    try:
        t0 = time.perf_counter()  # the warm runners' start: imports, plus one episode each
        await _round(envs["warm"], url, tasks[:CONCURRENCY])
        pool = envs["warm"].pool
        start = WarmStart(time.perf_counter() - t0, sum(_proc_cpu_s(p) for p in (pool.pids if pool else [])))
        await _round(envs["cold"], url, tasks[CONCURRENCY : CONCURRENCY + 1])  # page cache, like the warm side
        for k in range(ROUNDS):
            for way in ("cold", "warm"):
                batch = tasks[ROLLOUTS * (2 * k + (way == "warm") + 1) :][:ROLLOUTS]
                rounds[way].append(await _round(envs[way], url, batch))
    finally:
        for env in envs.values():
            await env.aclose()
        await model.aclose()
    return start, rounds


def openhands_benchmark(work: Path, machine: str) -> OpenhandsResults:
    """Both ways over ROUNDS alternated rounds."""
    import shutil

    from services.gym_gateway.envs.openhands import OpenHandsEnv

    python = OpenHandsEnv().python
    if not python.exists():
        raise RuntimeError(f"{python} is missing: run scripts/setup_openhands.sh")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start, rounds = asyncio.run(_run(work))
    return summarize(start, rounds["warm"], rounds["cold"], date=time.strftime("%Y-%m-%d"), machine=machine)


def _way(rs: list[Round]) -> Way:
    n = sum(r.rollouts for r in rs)
    return Way(
        rollouts=n,
        errors=sum(r.errors for r in rs),
        solved=sum(r.solved for r in rs),
        per_min=60 * n / sum(r.wall_s for r in rs),
        per_min_rounds=[60 * r.rollouts / r.wall_s for r in rs],
        cpu_per_rollout_s=sum(r.cpu_s for r in rs) / n,
        cpu_rounds=[r.cpu_s / r.rollouts for r in rs],
        error=next((r.error for r in rs if r.error), None),
    )


def summarize(start: WarmStart, warm: list[Round], cold: list[Round], *, date: str, machine: str) -> OpenhandsResults:
    """The section's figures from the rounds of both ways."""
    w, c = _way(warm), _way(cold)
    return OpenhandsResults(
        date=date,
        machine=machine,
        rollouts=ROLLOUTS,
        concurrency=CONCURRENCY,
        rounds=ROUNDS,
        start=start,
        warm=w,
        cold=c,
        per_min_ratio=w.per_min / c.per_min,
        cpu_ratio=w.cpu_per_rollout_s / c.cpu_per_rollout_s,
    )


def render_section(r: OpenhandsResults) -> str:
    return render("openhands", r=r)

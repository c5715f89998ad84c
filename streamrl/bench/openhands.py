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

`ScriptedModel` also serves the warm-runner integration tests.
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

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from services.gym_gateway.envs.base import ChatClient, Outcome
    from services.gym_gateway.envs.openhands import OpenHandsEnv

HEADING = "## OpenHands runners"
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
    first user message) and ``finish``, as native tool calls."""

    def __init__(self) -> None:
        self.calls = 0
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
        calls = [
            ("terminal", {"command": scripted_command(text)}),
            ("finish", {"message": "done"}),
        ]
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


async def _round(env: OpenHandsEnv, url: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
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
    return {
        "rollouts": len(outs),
        "errors": len(outs) - len(ok),
        "solved": sum(o.reward == 1.0 for o in ok),
        "wall_s": wall,
        "cpu_s": cpu,
        "error": next((repr(o) for o in outs if isinstance(o, BaseException)), None),
    }


async def _run(work: Path) -> dict[str, Any]:
    from services.gym_gateway.envs.openhands import OpenHandsEnv
    from shared.run_config import OpenHandsSection

    model = ScriptedModel()
    url = await model.start()
    envs = {
        "cold": OpenHandsEnv(OpenHandsSection(**OPENHANDS, workspace_root=str(work))),
        "warm": OpenHandsEnv(OpenHandsSection(**OPENHANDS, warm_runners=CONCURRENCY, workspace_root=str(work))),
    }
    tasks = envs["cold"].make_instances(ROLLOUTS * (2 * ROUNDS + 1), seed=7)
    rounds: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    try:
        t0 = time.perf_counter()  # the warm runners' start: imports, plus one episode each
        start = await _round(envs["warm"], url, tasks[:CONCURRENCY])
        start["wall_s"] = time.perf_counter() - t0
        start["runners_cpu_s"] = sum(_proc_cpu_s(p) for p in (envs["warm"].pool.pids if envs["warm"].pool else []))
        await _round(envs["cold"], url, tasks[CONCURRENCY : CONCURRENCY + 1])  # page cache, like the warm side
        for k in range(ROUNDS):
            for way in ("cold", "warm"):
                batch = tasks[ROLLOUTS * (2 * k + (way == "warm") + 1) :][:ROLLOUTS]
                rounds[way].append(await _round(envs[way], url, batch))
    finally:
        for env in envs.values():
            await env.aclose()
        await model.aclose()
    return {"rounds": rounds, "start": start, "model_calls": model.calls}


def openhands_benchmark(work: Path, machine: str) -> dict[str, Any]:
    """Both ways over ROUNDS alternated rounds; a JSON-able dict for `render_section`."""
    import shutil

    from services.gym_gateway.envs.openhands import OpenHandsEnv

    python = OpenHandsEnv().python
    if not python.exists():
        raise RuntimeError(f"{python} is missing: run scripts/setup_openhands.sh")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res = asyncio.run(_run(work))
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "rollouts": ROLLOUTS,
        "concurrency": CONCURRENCY,
        "rounds": ROUNDS,
        "start": res["start"],
    }
    for way, rs in res["rounds"].items():
        n = sum(r["rollouts"] for r in rs)
        out[way] = {
            "rollouts": n,
            "errors": sum(r["errors"] for r in rs),
            "solved": sum(r["solved"] for r in rs),
            "per_min": 60 * n / sum(r["wall_s"] for r in rs),
            "per_min_rounds": [60 * r["rollouts"] / r["wall_s"] for r in rs],
            "cpu_per_rollout_s": sum(r["cpu_s"] for r in rs) / n,
            "cpu_rounds": [r["cpu_s"] / r["rollouts"] for r in rs],
            "error": next((r["error"] for r in rs if r["error"]), None),
        }
    return out


def render_section(o: dict[str, Any]) -> str:
    cold, warm, start = o["cold"], o["warm"], o["start"]

    def rounds(xs: list[float], fmt: str) -> str:
        return " / ".join(fmt.format(x) for x in xs)

    met = all(w["errors"] == 0 and w["solved"] == w["rollouts"] for w in (cold, warm))
    lines = [
        f"{HEADING} (`streamrl bench --only openhands`: the OpenHands SDK agent on {o['rollouts']} file tasks a "
        f"round, {o['concurrency']} at once, scripted model (a terminal command and finish in one reply), "
        f"{o['rounds']} rounds each way, alternated; {o['date']}, {o['machine']})",
        "",
        f"| | warm runners ({o['concurrency']}) | one process per rollout (baseline) | warm / baseline |",
        "|---|---|---|---|",
        f"| rollouts / errors / solved | {warm['rollouts']} / {warm['errors']} / {warm['solved']} | "
        f"{cold['rollouts']} / {cold['errors']} / {cold['solved']} | |",
        f"| rollouts per minute | {warm['per_min']:.1f} | {cold['per_min']:.1f} | "
        f"{warm['per_min'] / cold['per_min']:.2f}x |",
        f"| CPU seconds per rollout | {warm['cpu_per_rollout_s']:.2f} | {cold['cpu_per_rollout_s']:.2f} | "
        f"{warm['cpu_per_rollout_s'] / cold['cpu_per_rollout_s']:.2f}x |",
        f"| per round: rollouts per minute | {rounds(warm['per_min_rounds'], '{:.1f}')} | "
        f"{rounds(cold['per_min_rounds'], '{:.1f}')} | |",
        f"| per round: CPU seconds per rollout | {rounds(warm['cpu_rounds'], '{:.2f}')} | "
        f"{rounds(cold['cpu_rounds'], '{:.2f}')} | |",
        "",
        f"Starting the warm runners (importing the SDK, then one episode each, before the measured rounds): "
        f"{start['wall_s']:.1f} s wall, {start['runners_cpu_s']:.1f} CPU s in the runners; paid once per "
        f"gateway worker. CPU counts this process (driver and scripted model, alike both ways), its reaped "
        f"children (one-shot runners, check commands) and the warm runners with their reaped children. "
        f"Target: no errors and every task solved both ways; {'met' if met else 'NOT met'}.",
        "",
    ]
    error = warm["error"] or cold["error"]
    if error:
        lines.insert(-1, f"First error: {error}")
    return "\n".join(lines)

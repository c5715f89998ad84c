"""One OpenHands SDK agent episode, run for the gym gateway's ``openhands`` environment.

Executed as a script by the OpenHands virtualenv's Python (the SDK needs Python >= 3.12 and its
own dependency tree), never imported by the gateway: it uses only the standard library and the
``openhands`` packages. The driver (``envs/openhands.py``) writes the job, starts this script in
its own process group and reads the result:

    python openhands_runner.py JOB.json RESULT.json     one episode, then exit
    python openhands_runner.py --serve TOOL...          a warm runner (``env.openhands.warm_runners``)

A warm runner imports the SDK (and the named tools) once, then runs episodes on request, each in
a child forked after the import: the ~10 s of CPU the import costs is paid per runner, not per
rollout. The child takes the episode's own working folder, environment (HOME, tmux socket folder)
and log file, and its own process group, which the driver kills at the deadline as it kills a
one-shot runner's. Protocol, one JSON object a line: the driver writes ``{"id", "job", "result",
"log", "cwd", "env"}`` on stdin; the runner answers ``{"ready": pid}`` once imported, then
``{"id", "pid"}`` when an episode's child started and ``{"id", "exit"}`` when it ended (the exit
status as ``asyncio`` reports it: negative for a signal). At stdin's end (the gateway is gone) it
kills its episodes' groups and exits.

Job (JSON object):
    base_url            the rollout's session proxy, ``.../sessions/<id>/v1`` (OpenAI-compatible)
    model, api_key      model name sent to the proxy (LiteLLM ``openai/<model>``) and a dummy key
    sampling            {temperature, top_p, max_tokens}: the task's sampling profile, sent on
                        every model call (the generator refuses training calls with other values)
    prompt, workspace   the user message and the folder the agent works in (a LocalWorkspace)
    max_iterations      cap on agent steps (one model call each)
    tools               OpenHands tool names (``terminal``, ``file_editor``, ...)
    default_tools       built-in tools kept (``FinishTool``, ``ThinkTool``)
    terminal_type       ``tmux``, ``subprocess`` or null (tmux when installed)
    native_tool_calling, system_prompt (null: OpenHands' own), llm_timeout_s, num_retries

Result (JSON object, written atomically): ``status`` (the conversation's final execution status:
finished, error, stuck, ...), ``iterations`` (model responses the agent acted on),
``actions`` (tool calls by tool name), ``error_kind`` (null, ``model_refused`` for a 4xx from the
model endpoint, ``transport`` for an unreachable or failing endpoint, ``setup_error`` when the
agent could not be built, e.g. an unknown tool, ``agent_error`` otherwise) and ``error``. Exit
status 0 whenever a result was written; anything else is a harness crash.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import sys
import traceback
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openhands.sdk import Agent

# Set before LiteLLM is imported: it would fetch its model-cost map from the network at import.
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "OPENHANDS_SUPPRESS_BANNER": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

_REFUSED = (
    "BadRequestError",
    "ContextWindowExceededError",
    "LLMBadRequestError",
    "LLMContextWindowExceedError",
    "UnprocessableEntityError",
    "NotFoundError",
    "LLMContextWindowTooSmallError",
)
_TRANSPORT = (
    "APIConnectionError",
    "Timeout",
    "APITimeoutError",
    "ServiceUnavailableError",
    "InternalServerError",
    "LLMTimeoutError",
    "LLMServiceUnavailableError",
    "LLMNoResponseError",
    "APIError",
    "ConnectError",
)


def classify(exc: BaseException) -> str:
    """``model_refused``, ``transport`` or ``agent_error`` for an exception and its causes."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        status = getattr(cur, "status_code", None)
        name = type(cur).__name__
        if (isinstance(status, int) and 400 <= status < 500) or name in _REFUSED:
            return "model_refused"
        if (isinstance(status, int) and status >= 500) or name in _TRANSPORT:
            return "transport"
        cur = getattr(cur, "original_exception", None) or cur.__cause__ or cur.__context__
    return "agent_error"


def build_agent(job: dict[str, Any]) -> Agent:
    from openhands.sdk import LLM, Agent, Tool
    from pydantic import SecretStr

    sampling = job["sampling"]
    llm = LLM(
        model=f"openai/{job['model']}",
        base_url=job["base_url"],
        api_key=SecretStr(job.get("api_key") or "none"),
        usage_id="agent",
        api_mode="chat",
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        max_output_tokens=sampling["max_tokens"],
        # Without these overrides the SDK drops temperature/top_p for a model it does not know.
        capability_overrides={"supports_sampling_params": True, "supports_reasoning_effort": False},
        reasoning_effort=None,
        native_tool_calling=job["native_tool_calling"],
        caching_prompt=False,
        timeout=int(job["llm_timeout_s"]),
        num_retries=job["num_retries"],
        retry_min_wait=1,
        retry_max_wait=4,
    )
    tools = []
    for name in job["tools"]:
        try:
            importlib.import_module(f"openhands.tools.{name}")  # registers the tool under its name
        except ModuleNotFoundError as exc:
            raise ValueError(f"unknown OpenHands tool {name!r} in env.openhands.tools ({exc})") from exc
        params = {"terminal_type": job["terminal_type"]} if name == "terminal" and job.get("terminal_type") else {}
        tools.append(Tool(name=name, params=params))
    return Agent(
        llm=llm, tools=tools, include_default_tools=list(job["default_tools"]), system_prompt=job.get("system_prompt")
    )


def summarise(events: Iterable[object]) -> tuple[int, dict[str, int]]:
    """(model responses the agent acted on, tool calls by tool name) from the event log."""
    responses: set[str] = set()
    actions: dict[str, int] = {}
    for ev in events:
        if getattr(ev, "source", None) != "agent":
            continue
        response_id = getattr(ev, "llm_response_id", None)
        if response_id:
            responses.add(response_id)
        tool_name = getattr(ev, "tool_name", None)
        if tool_name and type(ev).__name__ == "ActionEvent":
            actions[tool_name] = actions.get(tool_name, 0) + 1
    return len(responses), actions


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from openhands.sdk import Conversation

    agent = build_agent(job)
    conv = Conversation(
        agent=agent,
        workspace=job["workspace"],
        max_iteration_per_run=job["max_iterations"],
        visualizer=None,
        delete_on_close=True,
    )
    error: BaseException | None = None
    try:
        conv.send_message(job["prompt"])
        conv.run()
    except Exception as exc:  # the SDK wraps model and tool failures in ConversationRunError
        error = exc
    finally:
        status = str(getattr(conv.state.execution_status, "value", conv.state.execution_status))
        iterations, actions = summarise(list(conv.state.events))
        conv.close()
    result: dict[str, Any] = {
        "status": status,
        "iterations": iterations,
        "actions": actions,
        "error_kind": None,
        "error": None,
    }
    if error is not None:
        result["error_kind"] = classify(error)
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
    return result


def write_result(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def run_episode(job_path: str, result_path: str) -> int:
    """One episode from a job file to a result file; 0 once a result is written."""
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run_job(job)
    except Exception as exc:  # set-up failed before the episode (bad tool name, SDK error)
        traceback.print_exc()
        result = {
            "status": "error",
            "iterations": 0,
            "actions": {},
            "error_kind": "setup_error",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
        }
    write_result(result_path, result)
    return 0


def _isolate() -> None:
    """Drop this script's folder from ``sys.path`` (it holds the driver module ``openhands.py``,
    which would shadow the SDK) and set the offline settings before LiteLLM is imported."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def _episode_child(req: dict[str, Any]) -> None:
    """In the forked child: take the episode's log, folder and environment, run it, and leave
    without returning into the runner's loop (``os._exit``: the parent's exit handlers are not
    the child's)."""
    code = 1
    try:
        with contextlib.suppress(OSError):  # the parent may have made it the group leader already
            os.setpgid(0, 0)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        code = run_episode(req["job"], req["result"])
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def serve(tools: list[str]) -> int:
    """The warm runner's loop: import once, then fork a child per episode request and report its
    pid and exit status. Single-threaded (no reader thread), so forking is safe."""
    importlib.import_module("openhands.sdk")
    for name in tools:
        with contextlib.suppress(ImportError):  # an unknown tool fails its episode, as one-shot
            importlib.import_module(f"openhands.tools.{name}")
    children: dict[int, str] = {}  # pid -> request id
    _say({"ready": os.getpid()})
    buf = b""
    open_stdin = True
    while open_stdin:
        readable, _, _ = select.select([0], [], [], 0.2)
        if readable:
            chunk = os.read(0, 65536)
            open_stdin = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    req = json.loads(line)
                    sys.stdout.flush()  # nothing buffered is copied into the child
                    pid = os.fork()
                    if pid == 0:
                        _episode_child(req)
                    with contextlib.suppress(OSError):  # its own group before the driver may kill it
                        os.setpgid(pid, pid)
                    children[pid] = req["id"]
                    _say({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is not None:
                _say({"id": rid, "exit": os.waitstatus_to_exitcode(status)})
    for pid in children:  # the driver is gone: nothing of its episodes outlives the runner
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    return 0


def main(argv: list[str]) -> int:
    _isolate()
    if len(argv) >= 2 and argv[1] == "--serve":
        return serve(argv[2:])
    if len(argv) != 3:
        sys.stderr.write("usage: openhands_runner.py JOB.json RESULT.json | --serve TOOL...\n")
        return 2
    return run_episode(argv[1], argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The environment contract: what an environment is (`Environment`), what it reaches the model
with (`ModelClient`), what it returns (`Outcome`) and how it fails (`InfraError` and its kinds,
`ModelRequestError`, `ToolCallFailed`). A tool call the model got wrong is the model's mistake:
environments answer it with an error observation (`tool_call_error_observation` for text the
generator could not parse), never with an exception.

An environment runs one rollout at a time against the model and returns an `Outcome` with the
reward. Token ids never pass through it: the session proxy records every model call. The gateway
worker hands it a `ModelClient` bound to the rollout's session, in one of two ways:

    built-in loop (crossing, tool_calc, guess_number, echo, swe):  llm.chat(...)
        -> the session proxy, in the gateway's own process (`services.gym_gateway.session_client`)
    external agent (openhands, nemo_gym):  llm.base_url  (``http://<gateway>/sessions/<id>/v1``)
        -> the agent's own OpenAI client -> the gateway's session routes -> the session proxy

`ChatClient` is the same interface over HTTP, for a caller that holds only a session's URL.
Environments are built by the registry (`services.gym_gateway.envs.get_env`) with
``from_config``, and every one passes the contract test (tests/integration/test_env_contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self

import aiohttp
import msgspec

from services.gym_gateway.tool_call_errors import describe, failure_reason
from shared.openai_api import ChatCompletionResponse, ResponseMessage, ToolCallError
from shared.protocol import SamplingParams
from shared.sections.gateway import EnvSection


class InfraError(RuntimeError):
    """A rollout failed for a reason outside the policy (sandbox, harness, transport, generator
    gone). ``reason`` is the short label counted in metrics and carried as ``fallback_reason``."""

    reason = "infra"


class TransportError(InfraError):
    """The model could not be reached (generator gone, proxy error): an infrastructure failure."""

    reason = "transport"


class SandboxError(InfraError):
    """The rollout's sandbox or agent harness failed (workspace set-up, subprocess, container)."""

    reason = "sandbox"


class ModelRequestError(RuntimeError):
    """The model endpoint refused the request (4xx), e.g. the context is full."""


class ToolCallFailed(RuntimeError):
    """The model wrote tool calls that cannot be used and ``env.on_tool_call_error`` is ``end``:
    a policy failure, labelled ``tool_call_<reason>`` after the first error. Raised by the model
    client once the answer is recorded, so the rollout keeps its turns."""

    def __init__(self, errors: list[ToolCallError]) -> None:
        super().__init__(describe(errors))
        self.errors = errors
        self.reason = failure_reason(errors[0].reason)


def assistant_message(msg: ResponseMessage) -> dict[str, Any]:
    """The model's answer as the assistant message of the conversation (its tool calls kept)."""
    out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in msg.tool_calls
        ]
    return out


def tool_call_error_observation(msg: ResponseMessage) -> dict[str, Any] | None:
    """The environment's answer to tool calls the generator could not parse (their text stays in
    the assistant's content): a user message naming each error; None when every call parsed."""
    if not msg.tool_call_errors:
        return None
    return {"role": "user", "content": "\n".join(f"error: {e.message}" for e in msg.tool_call_errors)}


@dataclass
class Outcome:
    reward: float
    status: Literal["ok", "truncated", "env_flagged"] = "ok"
    metrics: dict[str, float] = field(default_factory=dict)
    mask_sample: bool = False  # "do not train on this rollout" (e.g. an iteration cap was hit)


class ModelClient(Protocol):
    """The model, as one rollout's session. ``chat`` raises `ModelRequestError` when the request is
    refused (4xx: a bad request, a full context), `TransportError` when the model cannot be
    reached (5xx, connection, timeout), and `ToolCallFailed` when the answer holds tool calls that
    cannot be used and ``env.on_tool_call_error`` is ``end``."""

    session_id: str
    sampling: SamplingParams | None  # the task's sampling profile, for agents that set their own
    base_url: str  # the session's OpenAI base URL (``.../sessions/<id>/v1``), for external agents
    http: aiohttp.ClientSession  # the gateway's HTTP client, for drivers that call agent servers
    timeout_s: float

    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **params: Any
    ) -> ChatCompletionResponse: ...


class Environment(Protocol):
    """An environment or agent-harness driver, registered by ``name`` in `services.gym_gateway.envs`
    and built once per gateway worker by ``from_config``; the worker calls ``aclose`` once at
    shutdown, after its rollouts ended."""

    name: str

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> Self:
        """Build from the run's ``env`` section (a driver reads its own sub-section, e.g.
        ``env.swe``; environments that need nothing ignore it)."""
        ...

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        """Run one episode against the model, at most ``max_turns`` model calls where the
        environment runs the loop itself; raise `InfraError` on an infrastructure failure."""
        ...

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` JSON-serialisable task instances, the same for the same ``seed`` (``streamrl
        data make``); a ValueError naming where the rows come from when the environment has no
        generator of its own."""
        ...

    async def aclose(self) -> None:
        """Stop what the environment keeps between rollouts (the OpenHands driver's warm runners);
        a no-op where nothing is kept. Called once, when the gateway shuts down."""
        ...


class ChatClient:
    """`ModelClient` over HTTP, for a caller that holds only a session's URL
    (``.../sessions/<id>/v1``): what a black-box agent sees. The gateway worker hands its
    environments a `services.gym_gateway.session_client.SessionClient` instead, which reaches the
    session proxy without a loopback HTTP call and fails the same way."""

    def __init__(
        self,
        base_url: str,
        http: aiohttp.ClientSession,
        *,
        timeout_s: float,
        sampling: SamplingParams | None = None,
        session_id: str = "",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout_s = timeout_s
        self.sampling = sampling
        self.session_id = session_id
        self._decoder = msgspec.json.Decoder(ChatCompletionResponse)

    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **params: Any
    ) -> ChatCompletionResponse:
        try:
            async with self.http.post(
                f"{self.base_url}/chat/completions",
                data=chat_body(messages, tools, params),
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                status, content = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise TransportError(f"model call failed: {type(exc).__name__}: {exc}") from exc
        text = content[:500].decode(errors="replace")
        if 400 <= status < 500:
            raise ModelRequestError(f"model refused the request ({status}): {text}")
        if status >= 500:
            raise TransportError(f"model endpoint error {status}: {text}")
        return self._decoder.decode(content)


def chat_body(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, params: dict[str, Any]) -> bytes:
    """The JSON body of a chat call, as both clients send it."""
    body: dict[str, Any] = {"messages": messages, **params}
    if tools:
        body["tools"] = tools
    return msgspec.json.encode(body)

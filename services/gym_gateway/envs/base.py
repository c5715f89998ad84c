"""The environment contract and the chat client agents use to reach the model.

An environment runs one rollout: it talks to the model only through `ChatClient` (an
OpenAI-compatible client pointed at the rollout's session proxy URL, exactly what a black-box agent
would be given) and returns an `Outcome` with the reward. Token ids never pass through the
environment: the session proxy records them. Environments are selected by name (`envs.get_env`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import msgspec

from shared.openai_api import ChatCompletionResponse
from shared.protocol import SamplingParams


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


@dataclass
class Outcome:
    reward: float
    status: Literal["ok", "truncated", "env_flagged"] = "ok"
    metrics: dict[str, float] = field(default_factory=dict)
    mask_sample: bool = False  # "do not train on this rollout" (e.g. an iteration cap was hit)


class ChatClient:
    """Minimal async OpenAI chat client for a session URL (``.../sessions/<id>/v1``).

    Harness drivers that run an external agent hand it ``base_url`` (an OpenAI-compatible endpoint)
    and pass ``sampling`` (the task's sampling profile) through to the agent's own LLM settings."""

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
        self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None, **params: Any
    ) -> ChatCompletionResponse:
        body: dict[str, Any] = {"messages": messages, **params}
        if tools:
            body["tools"] = tools
        try:
            async with self.http.post(
                f"{self.base_url}/chat/completions",
                data=msgspec.json.encode(body),
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


class Environment(Protocol):
    """An environment or agent-harness driver. Built once per gateway worker by
    ``envs.get_env(name, env_cfg)``: a class with ``from_config(env_cfg)`` gets the run's ``env``
    config section (its own sub-section, e.g. ``env.swe``), others are built without arguments."""

    name: str

    async def rollout(self, instance: dict[str, Any], llm: ChatClient, *, max_turns: int) -> Outcome:
        """Run one episode against the model; raise on infrastructure failure."""

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        """A dataset of ``n`` task instances (for built-in environments)."""

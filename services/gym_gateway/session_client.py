"""The model client the gateway worker hands every environment: one rollout's session, reached in
the gateway's own process.

    env.rollout -> SessionClient.chat(messages, tools=..., **params)
        -> the JSON body a `ChatClient` would send -> decode_body(ChatCompletionRequest)
                                                      (the session route's decoding and 400s)
        -> SessionProxy.chat(session_id, request)   (prepare, forward, record: the one recorder)
        -> ChatCompletionResponse

It fails as the HTTP path does (`services.gym_gateway.envs.base.ChatClient` through the session
routes): a 4xx from the proxy (bad body, unknown session, streaming, ``n``, a refusal the generator
passed through) is a `ModelRequestError`; a 5xx (generator gone, timed out, failed), a transport
error or an answer that cannot be read (a 500 over HTTP) is a `TransportError`. With
``env.on_tool_call_error: end`` an answer holding tool calls that cannot be used
(`services.gym_gateway.tool_call_errors`) raises `ToolCallFailed` once the proxy recorded it.

``base_url`` is the session's OpenAI base URL on this gateway, for environments whose agent runs
in another process (openhands' runner, NeMo-Gym's agent servers): they cannot call into this
process, so their model calls come back over HTTP to the session routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from services.gym_gateway.envs.base import ModelRequestError, ToolCallFailed, TransportError, chat_body
from services.gym_gateway.proxy import SessionProxy
from services.gym_gateway.tool_call_errors import find_tool_call_errors
from shared.http import HTTPError, decode_body
from shared.openai_api import ChatCompletionRequest, ChatCompletionResponse
from shared.protocol import SamplingParams


class SessionClient:
    """`services.gym_gateway.envs.base.ModelClient` for the session ``session_id`` of ``proxy``."""

    def __init__(
        self,
        proxy: SessionProxy,
        session_id: str,
        *,
        base_url: str,
        http: aiohttp.ClientSession,
        timeout_s: float,
        sampling: SamplingParams | None = None,
        end_on_tool_call_error: bool = False,
    ) -> None:
        self.proxy = proxy
        self.session_id = session_id
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout_s = timeout_s
        self.sampling = sampling
        self.end_on_tool_call_error = end_on_tool_call_error  # env.on_tool_call_error: end
        self._decoder = msgspec.json.Decoder(ChatCompletionResponse)

    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **params: Any
    ) -> ChatCompletionResponse:
        payload = chat_body(messages, tools, params)  # an environment's unencodable message is its own bug
        try:
            async with asyncio.timeout(self.timeout_s):
                request = decode_body(payload, ChatCompletionRequest)
                body = await self.proxy.chat(self.session_id, request)
            response = self._decoder.decode(body)
        except HTTPError as exc:
            if 400 <= exc.status < 500:
                raise ModelRequestError(f"model refused the request ({exc.status}): {exc.message}") from exc
            raise TransportError(f"model endpoint error {exc.status}: {exc.message}") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise TransportError(f"model call failed: {type(exc).__name__}: {exc}") from exc
        except msgspec.MsgspecError as exc:  # the generator's answer, unreadable (decode_body raises HTTPErrors)
            raise TransportError(f"model endpoint answered something unreadable: {exc}") from exc
        if self.end_on_tool_call_error and response.choices:
            errors = find_tool_call_errors(response.choices[0].message, tools)
            if errors:
                raise ToolCallFailed(errors)
        return response

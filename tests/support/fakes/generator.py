"""A stand-in generator whose answers a test scripts: policies instead of a model.

``ScriptedGenerator`` serves ``POST /v1/chat/completions`` and registers in a run's registry as a
ready generator serving weights v0 (as ``gen-scripted`` unless told another id), so a real gateway
(pool, session proxy, worker) routes sessions to it; ``delay_s`` makes it a slow one. Each call is
answered by the policy named by the head of its session id (the gateway's session ids start with
the task's group id: a task of group ``correct-3`` is played by the policy ``correct``). A policy
reads the request's messages and returns the model's turn (`say`, `call`, or `write`: raw model
text parsed as the generator parses it, malformed tool calls included), or raises `Refuse` to
answer with an error status.

Token ids are one per message, by role, and one generated id: a conversation that replays its
turns continues its token history exactly (no prefix break), one that rewrites it does not. The
generated id's logprob is -0.5 unless the policy's turn sets ``generation_log_probs`` (e.g. NaN,
which the answer carries as JSON ``null``, as the generator's encoder writes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.generator.tool_calls import parse_turn
from shared import keys as K
from shared.openai_api import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    FunctionCall,
    ResponseMessage,
    ToolCall,
    Usage,
)
from shared.protocol import Heartbeat
from shared.registry import HeartbeatTask
from streamrl.redis_server import free_port

ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
Policy = Callable[[list[ChatMessage]], ResponseMessage]


class Refuse(Exception):
    """Raised by a policy: the generator answers ``status`` with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def say(text: str) -> ResponseMessage:
    return ResponseMessage(content=text)


def call(name: str, arguments: dict[str, Any]) -> ResponseMessage:
    fn = FunctionCall(name=name, arguments=json.dumps(arguments))
    return ResponseMessage(content="", tool_calls=[ToolCall(id=f"call_{name}_{time.monotonic_ns()}", function=fn)])


def write(text: str) -> ResponseMessage:
    """The model's turn as raw text, parsed as the generator parses it when tools are offered:
    well-formed ``<tool_call>`` blocks become calls, the others stay in the content and are
    reported in ``tool_call_errors``."""
    parsed = parse_turn(text)
    return ResponseMessage(
        content=parsed.content,
        reasoning_content=parsed.reasoning_content,
        tool_calls=parsed.tool_calls or None,
        tool_call_errors=parsed.errors or None,
    )


class ScriptedGenerator:
    def __init__(self, policies: dict[str, Policy], *, delay_s: float = 0.0) -> None:
        self.policies = policies
        self.delay_s = delay_s  # each answer waits this long first (a slow generator)
        self.calls = 0
        self.app = FastAPI()
        self.app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])

    async def _chat(self, request: Request) -> Response:
        req = msgspec.json.decode(await request.body(), type=ChatCompletionRequest)
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        session_id = req.streamrl.session_id if req.streamrl else ""
        policy = self.policies[(session_id or "").split("-")[0]]
        try:
            turn = policy(req.messages)
        except Refuse as exc:
            error = {"error": {"message": str(exc), "type": "invalid_request_error", "param": None, "code": exc.status}}
            return JSONResponse(error, status_code=exc.status)
        prompt = [ROLE_IDS[m.role] for m in req.messages]
        turn = msgspec.structs.replace(
            turn,
            prompt_token_ids=prompt,
            generation_token_ids=[ROLE_IDS["assistant"]],
            generation_log_probs=turn.generation_log_probs or [-0.5],
        )
        out = ChatCompletionResponse(
            id="chatcmpl-scripted",
            created=int(time.time()),
            model="scripted",
            choices=[ChatChoice(index=0, message=turn, finish_reason="tool_calls" if turn.tool_calls else "stop")],
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=1, total_tokens=len(prompt) + 1),
            prompt_token_ids=prompt,
            weight_version=0,
            weight_version_end=0,
        )
        return Response(msgspec.json.encode(out), media_type="application/json")

    @contextlib.asynccontextmanager
    async def serving(
        self, serve_app, redis, run_keys: K.RunKeys, worker_id: str = "gen-scripted"
    ) -> AsyncIterator[str]:
        """Serve on a loopback port, registered as ready generator ``worker_id``; yields its URL."""
        port = free_port()
        async with serve_app(self.app, port) as url:
            beat = Heartbeat(
                worker_id=worker_id,
                kind="generator",
                url=url,
                pid=os.getpid(),
                host="scripted",
                state="ready",
                weight_version=0,
            )
            heartbeat = HeartbeatTask(redis, run_keys, lambda: beat)
            heartbeat.start()
            try:
                yield url
            finally:
                await heartbeat.aclose(beat.worker_id)

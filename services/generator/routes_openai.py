"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /tokenize.

Bodies are decoded by `shared.http.read_body` into the Structs of `shared.openai_api` (a 400 names
the field); the work is done by `services.generator.serving.GenerationService` on
``app.state.service``. Each generation request is counted by route and status, and traced
(`shared.tracing`, when on) as a child of the caller's W3C context: the weight versions of its
tokens, its token counts and this generator's worker id.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request

from services.generator.serving import GenerationService
from shared import tracing
from shared.http import HTTPError, MsgspecJSON, read_body
from shared.openai_api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from shared.openapi import json_body

router = APIRouter()


async def _counted(
    request: Request, route: str, work: Awaitable[ChatCompletionResponse | CompletionResponse]
) -> MsgspecJSON:
    requests = request.app.state.metrics.requests
    with tracing.server_span(f"generate.{route}", request.headers) as span:
        try:
            result = await work
        except HTTPError as exc:
            requests.labels(route, str(exc.status)).inc()
            tracing.set_attributes(span, {"http.response.status_code": exc.status})
            raise
        except Exception:
            requests.labels(route, "500").inc()
            raise
        requests.labels(route, "200").inc()
        tracing.set_attributes(span, _call_attributes(result, request.app.state.worker_id))
    return MsgspecJSON(result)


def _call_attributes(result: ChatCompletionResponse | CompletionResponse, worker_id: str) -> dict[str, Any]:
    """A model call's span attributes: the weight versions of its tokens, token counts, this generator."""
    spans = [v for c in result.choices for _, v in (c.weight_version_spans or ())]
    return {
        "streamrl.worker_id": worker_id,
        "streamrl.weight_version": result.weight_version,
        "streamrl.weight_version_end": result.weight_version_end,
        "streamrl.weight_versions": sorted(set(spans) or {result.weight_version}),
        "gen_ai.usage.input_tokens": result.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": result.usage.completion_tokens,
    }


def _service(request: Request) -> GenerationService:
    service: GenerationService = request.app.state.service
    return service


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> MsgspecJSON:
    body = await read_body(request, ChatCompletionRequest)
    return await _counted(request, "chat", _service(request).chat(body))


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> MsgspecJSON:
    body = await read_body(request, CompletionRequest)
    return await _counted(request, "completions", _service(request).completion(body))


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> MsgspecJSON:
    body = await read_body(request, TokenizeRequest)
    return MsgspecJSON(_service(request).tokenize(body))


@router.get("/v1/models")
async def models(request: Request) -> MsgspecJSON:
    svc = _service(request)
    card = ModelCard(
        id=svc.model_name,
        created=int(request.app.state.started_at),
        max_model_len=svc.max_model_len,
        weight_version=svc.runtime.weight_version,
    )
    return MsgspecJSON(ModelList(data=[card]))

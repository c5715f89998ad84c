"""OpenAI-compatible HTTP messages, with the token-level extensions RL needs.

Served by the generator, forwarded by the gateway's session proxy, sent by agents. Requests accept
(and ignore) extra fields that real clients send (``reasoning_effort``, ``prompt_cache_key``, ...).
Extensions, all optional for clients:
  * assistant messages may carry ``prompt_token_ids`` / ``generation_token_ids`` /
    ``generation_log_probs`` (NeMo-Gym's contract) and requests ``required_prefix_token_ids``: the
    generator then keeps the model's exact earlier tokens (the splice);
  * ``streamrl`` on a request tags it (train or validation) for the sampling gate;
  * responses carry ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` per
    choice (chat choices also vLLM's ``token_ids``) and the ``weight_version`` (at admission and
    at the last token) that produced them; a choice a refit split carries
    ``weight_version_spans`` ([first token index, version] per segment);
  * an assistant message in a response carries ``tool_call_errors``: the tool calls the model
    wrote that could not be parsed (their text stays in ``content``), null when there were none.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.routes import RouteShape


class _Lenient(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Unknown fields are accepted and dropped (clients send many)."""


class FunctionCall(_Lenient, kw_only=True, omit_defaults=False):  # also in responses: every field out
    name: str
    # A JSON string per the OpenAI spec; some agents send the object itself (kept as is: chat
    # templates serialise either).
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient, kw_only=True, omit_defaults=False):  # also in responses: every field out
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient, kw_only=True, omit_defaults=True):
    role: str
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


class RequestTag(_Lenient, kw_only=True, omit_defaults=True):
    """streamrl's request tag: which sampling profile applies and which session it belongs to."""

    kind: Literal["train", "validation"] = "train"
    session_id: str | None = None


class ChatCompletionRequest(_Lenient, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    required_prefix_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # With policy.moe_routing_replay: the first prompt position whose MoE routes to return (those
    # before it came with earlier turns); 0 when unset.
    routes_from: int | None = None
    streamrl: RequestTag | None = None
    stream: bool = False


class CompletionRequest(_Lenient, kw_only=True, omit_defaults=True):
    prompt: str | list[int]
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    routes_from: int | None = None  # as ChatCompletionRequest's
    streamrl: RequestTag | None = None
    stream: bool = False


class TokenizeRequest(_Lenient, kw_only=True, omit_defaults=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    required_prefix_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class ToolCallError(msgspec.Struct, kw_only=True):
    """A tool call the model wrote that cannot be used; ``reason`` is one of TOOL_CALL_ERROR_REASONS."""

    reason: str
    message: str


# Why a tool call cannot be used. The generator finds the first four in the text it parses; the
# gateway checks every parsed call against the tools the request offered (``invalid_arguments``:
# not a JSON object, ``unknown_tool``).
TOOL_CALL_ERROR_REASONS = ("invalid_json", "missing_name", "unclosed_tag", "invalid_arguments", "unknown_tool")


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_errors: list[ToolCallError] | None = None  # tool-call blocks that could not be parsed
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    generation_token_ids: list[int] = msgspec.field(default_factory=list)
    generation_log_probs: list[float] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    # vLLM's field: NeMo-Gym's vllm_model expects it whenever prompt_token_ids is in the response.
    token_ids: list[int] | None = None
    # [first generated token index, weight version] per segment when a refit split this choice.
    weight_version_spans: list[list[int]] | None = None
    # With policy.moe_routing_replay: the MoE routes of positions routes_start .. (prompt +
    # generated - 2), packed (`shared.routes`, base64; the response's route_shape); None when the
    # engine has none for this choice (vLLM: a preempted request).
    routes: str | None = None
    routes_start: int | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]
    weight_version: int
    weight_version_end: int
    route_shape: RouteShape | None = None  # with policy.moe_routing_replay
    object: str = "chat.completion"


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    generation_token_ids: list[int] = msgspec.field(default_factory=list)
    generation_log_probs: list[float] = msgspec.field(default_factory=list)
    weight_version_spans: list[list[int]] | None = None  # as ChatChoice's
    routes: str | None = None  # as ChatChoice's
    routes_start: int | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int]
    weight_version: int
    weight_version_end: int
    route_shape: RouteShape | None = None  # with policy.moe_routing_replay
    object: str = "text_completion"


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "streamrl"
    max_model_len: int = 0
    weight_version: int = -1
    object: str = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"

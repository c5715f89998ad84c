"""OpenAI Responses API messages (non-streaming) as NeMo-Gym speaks them.

Served by the gym gateway's per-rollout Responses endpoint, which makes the gateway look like a
NeMo-Gym model server to NeMo-Gym agents. Requests follow NeMo-Gym's
``NeMoGymResponseCreateParamsNonStreaming``; unknown fields are dropped. Input items arrive as
JSON objects and are decoded one by one into the item Structs below (an easy-input message may
omit ``type``), so a bad item is a 400 naming ``input[i]``.

Token extension (NeMo-Gym's "ForTraining" items): the last output item of a model turn
(``reasoning``, ``message`` or ``function_call``) carries ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs``; agents replay such items unchanged, and
the three fields travel together or not at all. ``routed_experts`` (MoE routing) is accepted and
ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class _Lenient(msgspec.Struct, kw_only=True):
    """Unknown fields are accepted and dropped (NeMo-Gym and the OpenAI SDK add fields over time)."""


class _Tokens(_Lenient, kw_only=True):
    """The token fields of a model-generated item; UNSET fields are left out of the JSON (null is
    read as absent)."""

    prompt_token_ids: list[int] | None | UnsetType = UNSET
    generation_token_ids: list[int] | None | UnsetType = UNSET
    generation_log_probs: list[float] | None | UnsetType = UNSET
    routed_experts: Any = UNSET


# -- request ---------------------------------------------------------------------------------------


class ResponsesRequest(_Lenient, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    stream: bool | None = None


class InputMessage(_Tokens, tag_field="type", tag="message", kw_only=True):
    """A message item: an easy-input message (string content) or a message with content parts."""

    role: Literal["user", "system", "developer", "assistant"]
    content: Any = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Lenient, tag_field="type", tag="function_call_output", kw_only=True):
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class SummaryText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "summary_text"


class ReasoningItem(_Tokens, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    summary: list[SummaryText]
    encrypted_content: str | None = None


class FunctionCallItem(_Tokens, tag_field="type", tag="function_call", kw_only=True):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


InputItem = InputMessage | FunctionCallOutputItem | ReasoningItem | FunctionCallItem
INPUT_ITEM_TYPES = ("message", "function_call_output", "reasoning", "function_call")


# -- response --------------------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    type: str = "output_text"


class OutputMessage(_Tokens, tag_field="type", tag="message", kw_only=True):
    id: str
    content: list[OutputText]
    role: str = "assistant"
    status: str = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # required by recent OpenAI SDKs


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponsesResponse(msgspec.Struct, kw_only=True):
    """A NeMo-Gym ``NeMoGymResponse``; every field of OpenAI's ``Response`` the agents read is
    present (nullable ones as null). ``weight_version``/``weight_version_end`` are streamrl's."""

    id: str
    created_at: float
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    status: str = "completed"
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    user: str | None = None
    usage: ResponseUsage | None = None
    weight_version: int = -1
    weight_version_end: int = -1
    object: str = "response"

"""Chat prompts: message normalisation, template rendering and the prefix splice, as token ids.

Pipeline for one request (the same for /v1/chat/completions and /tokenize)::

    messages --normalise--> plain dicts (content as text, roles checked, bookkeeping stripped)
             --render-----> T = template(all messages, tools, generation prompt) as ids
    model prefix M (required_prefix_token_ids, or the last assistant message's
                    prompt_token_ids + generation_token_ids)
             --render-----> P = template(messages up to that assistant turn, no generation prompt)
    prompt = splice(M, P, T)          (T itself when there is no M)

Content is normalised before any rendering (spec 8.5): strings stay, lists of text parts are
joined, ``None`` (e.g. with tool calls) becomes empty, dicts are one part, other iterables are
lists of parts, numbers become strings, images are refused. Both renders use the same normalised
messages, so ``P`` and ``T`` agree on the history. Invalid input is a 400 naming the field.
Called by `services.generator.serving`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.generator.splice import SpliceError, splice_by_count
from shared.http import HTTPError, bad_request
from shared.openai_api import ChatMessage

ROLES = ("system", "user", "assistant", "tool", "developer")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")
_MEDIA_PART_TYPES = ("image_url", "image", "input_image", "audio", "input_audio", "video", "file")
# Keys of chat_template_kwargs that would override what the server controls.
_RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "conversation",
    "tools",
    "add_generation_prompt",
    "tokenize",
    "chat_template",
    "return_dict",
    "continue_final_message",
    "documents",
)
STREAMRL_TAG = "streamrl"


def normalize_content(content: Any, where: str) -> str:
    """Message content as the text the template renders; a 400 naming ``where`` if unusable."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (bool, int, float)):
        return str(content)
    if isinstance(content, dict):
        return _part_text(content, f"{where}[0]")
    if isinstance(content, Iterable) and not isinstance(content, (bytes, bytearray)):
        texts = [_part_text(part, f"{where}[{j}]") for j, part in enumerate(content)]
        return "\n".join(t for t in texts if t)
    return ""  # not iterable, not text: nothing to render (spec 8.5: coerce to an empty list)


def _part_text(part: Any, where: str) -> str:
    if part is None:
        return ""
    if isinstance(part, str):
        return part
    if isinstance(part, (bool, int, float)):
        return str(part)
    if isinstance(part, dict):
        kind = part.get("type")
        if kind in _MEDIA_PART_TYPES:
            raise bad_request(f"{where} is a {kind!r} part; this generator serves text only", param=where)
        text = part.get("text")
        if (kind is None or kind in _TEXT_PART_TYPES) and isinstance(text, str):
            return text
        raise bad_request(f"{where} is an unsupported content part (type {kind!r})", param=where)
    raise bad_request(f"{where} is a {type(part).__name__}, not a content part", param=where)


def normalize_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the template, without the token bookkeeping fields."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": normalize_content(m.content, f"messages[{i}].content")}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": tc.type,
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def template_kwargs(raw: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` without streamrl's tag; a 400 for keys the server controls."""
    kwargs = dict(raw or {})
    kwargs.pop(STREAMRL_TAG, None)
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs.{key} is set by the server", param=f"chat_template_kwargs.{key}")
    return kwargs


def model_prefix(messages: Sequence[ChatMessage], required: list[int] | None) -> tuple[list[int], int]:
    """(M, index of the last message P renders); M is empty when nothing carries token ids."""
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=len(messages) - 1)
    if required is not None:
        return list(required), last_assistant
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role != "assistant" or (m.prompt_token_ids is None and m.generation_token_ids is None):
            continue
        if m.prompt_token_ids is None or m.generation_token_ids is None:
            missing = "prompt_token_ids" if m.prompt_token_ids is None else "generation_token_ids"
            raise bad_request(
                f"messages[{i}] carries only one of prompt_token_ids/generation_token_ids; {missing} is missing",
                param=f"messages[{i}].{missing}",
            )
        return list(m.prompt_token_ids) + list(m.generation_token_ids), i
    return [], last_assistant


@dataclass(frozen=True)
class ChatPrompt:
    """The ids fed to the engine and how they were made."""

    prompt_ids: list[int]
    template_ids: list[int]  # T: the template's rendering of the whole request
    model_prefix_len: int
    # P as text: the template's rendering of the history up to the last assistant turn, from the
    # same normalised messages as T (empty when there was no model prefix).
    history_text: str = ""


class ChatRenderer:
    """Renders chat requests to token ids with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, turn_terminator: str | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        if turn_terminator is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no EOS token; set generator.turn_terminator")
            self.terminator_id = int(tokenizer.eos_token_id)
        else:
            tid = tokenizer.convert_tokens_to_ids(turn_terminator)
            if tid is None or tid == tokenizer.unk_token_id:
                raise ValueError(f"generator.turn_terminator {turn_terminator!r} is not a token of the tokenizer")
            self.terminator_id = int(tid)
        self.terminator_text = tokenizer.convert_ids_to_tokens(self.terminator_id)
        self._terminator_is_added_token = self.terminator_text in tokenizer.get_added_vocab()
        self.eos_id = tokenizer.eos_token_id
        # What ends an assistant turn: the turn terminator, and EOS where the tokenizer has one.
        self.turn_stop_ids = frozenset(
            {self.terminator_id} | ({int(self.eos_id)} if self.eos_id is not None else set())
        )
        self.vocab_size = max(vocab_size, len(tokenizer))

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def encode_text(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not self._terminator_is_added_token:
            return ids  # an ordinary vocabulary piece: its text form is not countable in the text
        expected = text.count(self.terminator_text)
        got = sum(1 for t in ids if t == self.terminator_id)
        if expected != got:
            # The template wrote the terminator as text but the tokenizer did not map it to its id:
            # the splice would count the wrong turns, so refuse rather than serve a skewed prompt.
            raise HTTPError(
                500,
                f"tokenizer encoded {got} turn terminator ids for {expected} occurrences of "
                f"{self.terminator_text!r} in the rendered prompt; check generator.turn_terminator",
            )
        return ids

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        try:
            text: str = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
            return text
        except Exception as exc:  # jinja errors: the request's messages do not fit the template
            raise bad_request(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}", param="messages"
            ) from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> list[int]:
        return self.encode_text(self.render_text(messages, tools, add_generation_prompt, kwargs))

    def count_terminators(self, text: str) -> int:
        """Turn terminators in rendered ``text``: counted in the text when the terminator is an
        added token (``encode_text`` guarantees each occurrence becomes exactly its id), else by
        tokenising."""
        if self._terminator_is_added_token:
            return text.count(self.terminator_text)
        return sum(1 for t in self.encode_text(text) if t == self.terminator_id)

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"{param} holds token id {t}, outside the vocabulary (0..{self.vocab_size - 1})", param=param
                )

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        required_prefix_token_ids: list[int] | None = None,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        """Normalise, render and splice one request."""
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        kwargs = template_kwargs(chat_template_kwargs)
        normalized = normalize_messages(messages)
        full = self.render(normalized, tools, add_generation_prompt, kwargs)
        prefix, last = model_prefix(messages, required_prefix_token_ids)
        if not prefix:
            return ChatPrompt(prompt_ids=full, template_ids=full, model_prefix_len=0)
        self.check_ids(
            prefix, "required_prefix_token_ids" if required_prefix_token_ids is not None else f"messages[{last}]"
        )
        history = self.render_text(normalized[: last + 1], tools, False, kwargs)
        try:
            ids = splice_by_count(prefix, self.count_terminators(history), full, self.terminator_id, self.decode)
        except SpliceError as exc:
            raise bad_request(str(exc), param="messages") from exc
        return ChatPrompt(prompt_ids=ids, template_ids=full, model_prefix_len=len(prefix), history_text=history)

"""A session's token context, and the part of a generator's answer the session proxy records.

The proxy sees every model call of a session: the generator's answer repeats the whole prompt's
ids (at the top and again in the message), and the next request carries the session's context
back as ``required_prefix_token_ids``. Done with Python lists, each call decoded thousands of ids
twice into int objects, compared them with the context, and encoded the context again; with the
answers of a few hundred sessions arriving at once that queued calls on the gateway's event loop
for hundreds of milliseconds, and a context held as a list costs about 36 bytes a token (a
gateway holding thousands of agent sessions of tens of thousands of tokens each runs out of memory).

So the proxy decodes answers into `RecordedChat` / `RecordedCompletion`: the prompt ids stay raw
JSON and the message's copy is skipped unparsed. The context is a `TokenHistory`: the JSON array
itself (a few bytes a token), sent back verbatim. A prompt that continues it (the usual case) is
recognised by one byte comparison, and only its new ids are decoded; any other prompt (a prefix
break, or a generator that formats its JSON differently) is decoded in full and compared id by id,
so what is recorded is exactly what a full decode gives.
"""

from __future__ import annotations

import msgspec

from shared.openai_api import ToolCall, ToolCallError, Usage
from shared.routes import RouteShape

_ids = msgspec.json.Decoder(list[int])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. Slice comparisons run in C: one for the usual case
    (``b`` continues ``a``), a binary search otherwise; a Python loop per token would cost
    milliseconds per call at agent context lengths."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] holds; a[:hi + 1] != b[:hi + 1] is known
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TokenHistory:
    """Every token of a session so far (prompts and generations), as the compact JSON array
    (``[1,2,3]``, no spaces) that goes to the generator as ``required_prefix_token_ids``."""

    __slots__ = ("json", "length")

    def __init__(self) -> None:
        self.json = b"[]"
        self.length = 0

    def ids(self) -> list[int]:
        return _ids.decode(self.json)

    def split(self, prompt: msgspec.Raw) -> tuple[int, list[int]]:
        """(how many tokens of the context ``prompt`` keeps, the prompt's ids after them). When the
        prompt's JSON starts with the context's up to a delimiter, its first ``length`` ids are the
        context's, digit for digit; only the rest is decoded."""
        raw = bytes(prompt)
        if self.length:
            head = self.json[:-1]  # "[a,...,z": every id of the context, the last one complete below
            after = raw[len(head) : len(head) + 1]
            if after in (b",", b"]") and raw.startswith(head):
                return self.length, _ids.decode(b"[" + raw[len(head) + 1 :]) if after == b"," else []
        ids = _ids.decode(raw)
        keep = common_prefix_len(self.ids(), ids) if self.length else 0
        return keep, ids[keep:]

    def advance(self, keep: int, new: list[int]) -> None:
        """The context becomes its first ``keep`` tokens followed by ``new``."""
        if keep == self.length:
            if new:  # "[a,b" + "," + "c,d]", or "[" + "c,d]" for an empty context
                self.json = self.json[:-1] + (b"," if self.length else b"") + msgspec.json.encode(new)[1:]
        else:
            self.json = msgspec.json.encode(self.ids()[:keep] + new)
        self.length = keep + len(new)


# -- what the proxy reads of an answer: the generator's structs (shared.openai_api), with the
# prompt's ids raw and the message's copy of them (and the choice's token_ids) left unparsed.


class RecordedMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_errors: list[ToolCallError] | None = None
    generation_token_ids: list[int] = msgspec.field(default_factory=list)
    generation_log_probs: list[float] = msgspec.field(default_factory=list)


class RecordedChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: RecordedMessage
    finish_reason: str
    weight_version_spans: list[list[int]] | None = None
    routes: str | None = None
    routes_start: int | None = None


class RecordedChat(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[RecordedChatChoice]
    usage: Usage
    prompt_token_ids: msgspec.Raw
    weight_version: int
    weight_version_end: int
    route_shape: RouteShape | None = None


class RecordedCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str
    generation_token_ids: list[int] = msgspec.field(default_factory=list)
    generation_log_probs: list[float] = msgspec.field(default_factory=list)
    weight_version_spans: list[list[int]] | None = None
    routes: str | None = None
    routes_start: int | None = None


class RecordedCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[RecordedCompletionChoice]
    usage: Usage
    prompt_token_ids: msgspec.Raw
    weight_version: int
    weight_version_end: int
    route_shape: RouteShape | None = None

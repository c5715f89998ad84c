"""The token splice: keep the model's exact earlier tokens when an agent replays its history as text.

RL trains on token ids, agents speak text. Re-rendering an earlier assistant turn through the chat
template can tokenise differently from what the model sampled (merges, invalid UTF-8 pieces,
stripped reasoning), so the next prompt would not start with the previous prompt + generation.
The splice (behavioural spec 8.4) takes

* ``M``: the model's own tokens up to the end of the last assistant turn (prompt + generation),
* ``P``: the template render of the messages up to and including that assistant turn, without
  a generation prompt,
* ``T``: the template render of the whole request,

counts the turn terminators in ``P`` (k), finds the k-th terminator in ``T`` (position j) and
returns ``M`` (without a trailing terminator) followed by ``T[j:]``: the turn's closing terminator
and everything after it (new tool/user messages, the generation prompt) come from the template.
Counting terminators rather than comparing positions survives templates that strip ``<think>``
blocks from older turns (positions shift, the number of turns does not).

The terminator is a parameter (``generator.turn_terminator``), not assumed to be EOS. Called by
`services.generator.chat` for chat and tokenize requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_SHOWN_CHARS = 400


class SpliceError(ValueError):
    """The model prefix cannot be joined to the rendered request; the message shows both sides."""


def splice_prefix(
    model_prefix: Sequence[int],
    template_prefix: Sequence[int],
    template_full: Sequence[int],
    terminator_id: int,
    decode: Callable[[Sequence[int]], str],
) -> list[int]:
    """``M[:cut] + T[j:]`` as described in the module docstring; ``T`` unchanged when ``M`` is empty."""
    k = sum(1 for t in template_prefix if t == terminator_id)
    return splice_by_count(model_prefix, k, template_full, terminator_id, decode)


def splice_by_count(
    model_prefix: Sequence[int],
    k: int,
    template_full: Sequence[int],
    terminator_id: int,
    decode: Callable[[Sequence[int]], str],
) -> list[int]:
    """The splice given ``k``, the number of turn terminators in ``P`` (the renderer counts them in
    the rendered text when the terminator is a special token, which saves tokenising ``P``)."""
    if not model_prefix:
        return list(template_full)
    cut = len(model_prefix) - 1 if model_prefix[-1] == terminator_id else len(model_prefix)
    if k == 0:
        raise SpliceError(
            _diagnose("the rendered history has no turn terminator", model_prefix, template_full, terminator_id, decode)
        )
    j = _kth_index(template_full, terminator_id, k)
    if j is None:
        have = sum(1 for t in template_full if t == terminator_id)
        raise SpliceError(
            _diagnose(
                f"the rendered request has {have} turn terminator(s), the history needs {k}",
                model_prefix,
                template_full,
                terminator_id,
                decode,
            )
        )
    return list(model_prefix[:cut]) + list(template_full[j:])


def _kth_index(ids: Sequence[int], token: int, k: int) -> int | None:
    seen = 0
    for i, t in enumerate(ids):
        if t == token:
            seen += 1
            if seen == k:
                return i
    return None


def _tail(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else "..." + text[-_SHOWN_CHARS:]


def _diagnose(
    what: str,
    model_prefix: Sequence[int],
    template_full: Sequence[int],
    terminator_id: int,
    decode: Callable[[Sequence[int]], str],
) -> str:
    return (
        f"cannot splice the model's earlier tokens into the prompt: {what} "
        f"(turn terminator {decode([terminator_id])!r}, id {terminator_id}; see generator.turn_terminator). "
        f"model tokens ({len(model_prefix)}): {_tail(decode(model_prefix))!r}; "
        f"rendered request ({len(template_full)}): {_tail(decode(template_full))!r}"
    )

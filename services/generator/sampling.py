"""The on-policy sampling gate and the output budget (behavioural spec 8.2-8.3).

Training samples are only useful if they come from the training sampling distribution, so a
request may not choose its own: requests tagged ``streamrl.kind == "validation"`` get the
validation profile (``policy.generation.val_*``), every other request the training profile.
Absent ``temperature``/``top_p`` are filled from the profile; a given value that differs is a 400
naming the parameter; ``top_k`` must be unset or -1. The tag decides the profile, never the
values (a training request carrying validation values is refused: spec section 14, item 11).

The output budget is ``min(requested or max_new_tokens, max_new_tokens, max_model_len -
prompt_len)``; a prompt that leaves no room is a 400. Called by `services.generator.serving`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.http import HTTPError, bad_request
from shared.sections.generator import GenerationSection

_TOLERANCE = 1e-6
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128  # OpenAI's own cap on n; more would let one request exhaust the engine's memory


@dataclass(frozen=True)
class ResolvedSampling:
    kind: Literal["train", "validation"]
    temperature: float
    top_p: float


def resolve_sampling(
    generation: GenerationSection,
    kind: Literal["train", "validation"],
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
) -> ResolvedSampling:
    """The profile's parameters for ``kind``; a 400 naming the first parameter that disagrees."""
    profile = generation.sampling(kind)
    if top_k not in (None, -1):
        raise bad_request(f"top_k must be unset or -1 (got {top_k}): samples must stay on-policy", param="top_k")
    for name, given, expected in (("temperature", temperature, profile.temperature), ("top_p", top_p, profile.top_p)):
        if given is not None and abs(given - expected) > _TOLERANCE:
            raise bad_request(
                f"{name}={given} differs from the {kind} sampling profile ({name}={expected}); "
                f"leave it unset or send the profile's value",
                param=name,
            )
    return ResolvedSampling(kind=kind, temperature=profile.temperature, top_p=profile.top_p)


def requested_max_tokens(generation: GenerationSection, requested: int | None, param: str = "max_tokens") -> int:
    """The request's cap, defaulted and clamped to ``policy.generation.max_new_tokens``."""
    if requested is None:
        return generation.max_new_tokens
    if requested < 1:
        raise bad_request(f"{param} must be >= 1 (got {requested})", param=param)
    return min(requested, generation.max_new_tokens)


def output_budget(max_tokens: int, prompt_len: int, max_model_len: int) -> int:
    """Tokens the engine may generate after a ``prompt_len``-token prompt."""
    if prompt_len > max_model_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} tokens",
            param="messages",
        )
    room = max_model_len - prompt_len
    if room <= 0:
        raise HTTPError(
            400,
            f"no room for output: the prompt's {prompt_len} tokens fill the {max_model_len}-token context",
            param="messages",
        )
    return min(max_tokens, room)


def check_choices(n: int, top_logprobs: int | None) -> int:
    """Validate ``n`` and ``top_logprobs``; the number of alternatives to report."""
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES} (got {n})", param="n")
    if top_logprobs is None:
        return 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS} (got {top_logprobs})", param="top_logprobs"
        )
    return top_logprobs

"""Generations that span a refit: interrupted at the weight swap, continued under the new weights.

With in-flight weight updates (``grpo.async_grpo.in_flight_weight_updates``) a refit does not wait
for running generations. Freezing them and resuming on the new weights (vLLM's "keep") would
continue from a KV cache computed under the old weights: the tokens after the swap would come
from neither version, and their recorded logprobs would belong to no policy the trainer can
evaluate. So the refit interrupts them instead (the engine's ``interrupt`` pause: each running
request ends at once with the tokens it has, finish reason ``abort``), and once the new version
serves, each interrupted choice is continued as a new request whose prompt is the old prompt plus
the tokens generated so far. The prefix is encoded again under the new weights (the prefix cache
was reset by the refit anyway), so every token is sampled by exactly one version, and its logprob
is that version's: the per-token behaviour logprobs the trainer's importance weights need.

Each choice then carries ``version_spans``: ``(first token index, weight version)`` per segment,
in order, recorded only when the choice spans more than one version. This is the partial rollout
of AReaL and prime-rl, done per request inside the generator, so agents and the gateway see one
ordinary response.

Limits: a text stop string split across a swap (its first characters before, the rest after) is
not seen by the engine; the response text is still cut at it, the tokens are kept. A seeded
request is continued with a seed derived from its own and the tokens so far.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from services.generator.engine import ChoiceOutput, GenerationParams
from services.generator.runtime import Runtime


def was_interrupted(c: ChoiceOutput, runtime: Runtime, interrupts_before: int) -> bool:
    """Whether ``c`` ended because a refit interrupted it (not for any other reason)."""
    return c.finish_reason == "abort" and runtime.interrupts > interrupts_before


@dataclass(frozen=True)
class _Request:
    runtime: Runtime
    prompt_ids: list[int]
    params: GenerationParams
    request_id: str
    session_id: str | None


async def continue_interrupted(
    runtime: Runtime,
    prompt_ids: list[int],
    params: GenerationParams,
    request_id: str,
    choices: list[ChoiceOutput],
    interrupts_before: int,
    first_version: int,
    session_id: str | None = None,
) -> list[ChoiceOutput]:
    """``choices`` with every choice a refit interrupted continued until it finishes on its own
    (however many refits it meets); the others unchanged."""
    req = _Request(runtime, prompt_ids, params, request_id, session_id)
    return list(await asyncio.gather(*(_continue(req, c, interrupts_before, first_version) for c in choices)))


async def _continue(req: _Request, c: ChoiceOutput, interrupts_before: int, first_version: int) -> ChoiceOutput:
    rt, params = req.runtime, req.params
    spans: list[tuple[int, int]] = [(0, first_version)] if c.token_ids else []
    part = 0
    while was_interrupted(c, rt, interrupts_before):
        interrupts_before = rt.interrupts
        version = await rt.reopened(req.session_id)
        left = params.max_tokens - len(c.token_ids)
        if left <= 0:
            c = replace(c, finish_reason="length")
            break
        part += 1
        seed = None if params.seed is None else params.seed + len(c.token_ids)
        sub = replace(params, n=1, max_tokens=left, seed=seed)
        (more,) = await rt.engine.generate(req.prompt_ids + c.token_ids, sub, f"{req.request_id}-{c.index}.{part}")
        if more.token_ids and (not spans or spans[-1][1] != version):
            spans.append((len(c.token_ids), version))
        c = _joined(c, more)
    if len(spans) > 1:
        c = replace(c, version_spans=tuple(spans))
    return c


def _joined(head: ChoiceOutput, tail: ChoiceOutput) -> ChoiceOutput:
    top = None
    if head.top_logprobs is not None and tail.top_logprobs is not None:
        top = head.top_logprobs + tail.top_logprobs
    return replace(
        head,
        token_ids=head.token_ids + tail.token_ids,
        logprobs=head.logprobs + tail.logprobs,
        finish_reason=tail.finish_reason,
        top_logprobs=top,
        # The continuation ran the whole sequence again from the same position: its routes cover
        # the joined choice (on the weights that finished it).
        routes=tail.routes,
    )

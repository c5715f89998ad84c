"""Every refit verified: each generator scores a fixed probe sequence at the version it was just
sent, and the trainer compares with its own logprobs at that version (``refit.probe_tokens``,
``refit.max_probe_error``).

A transfer's checksums prove the bytes arrived; the probe proves the engine computes with them
(a loader that put a slice in the wrong place, a kernel's packed copy left stale, a dtype
mishap: all invisible to the checksums, all visible here). Both sides score from the raw logits
(temperature 1, no nucleus): vLLM's prompt logprobs are raw whatever its logprobs mode. The probe
is the same text every refit, encoded once with the policy's tokenizer; its error is the mean
absolute logprob difference over its tokens, recorded per refit (`RefitReport.probe_error`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from shared.protocol import WeightAck

if TYPE_CHECKING:
    from shared.run_config import RunConfig

log = logging.getLogger(__name__)

TEXT = (
    "The committee met on a cold Tuesday morning to review the budget. After two hours of discussion, "
    "they agreed to fund the new library, repair the bridge over the river, and plant four hundred trees "
    "along the main road before the end of the year."
)


class ProbeMismatch(RuntimeError):
    """A generator scored the probe unlike the trainer at the same version."""


def probe_tokens(tokenizer_path: str, n: int) -> list[int]:
    """The probe's first ``n`` token ids under the policy's tokenizer (the text repeated as needed)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    ids: list[int] = []
    while len(ids) < n:
        ids += list(tokenizer.encode(TEXT, add_special_tokens=False))
    return ids[:n]


class RefitProbe:
    """The probe of one run: its tokens, the trainer's logprobs per version, the check."""

    def __init__(self, tokens: list[int], score: Callable[[list[int]], Awaitable[list[float]]], bound: float) -> None:
        self.tokens = tokens
        self.score = score
        self.bound = bound
        self._version: int | None = None
        self._expected: list[float] = []

    async def prepare(self, version: int) -> None:
        """The trainer's logprobs at ``version`` (the weights it is about to send)."""
        if self._version != version:
            self._expected = await self.score(self.tokens)
            self._version = version

    def check(self, version: int, acks: dict[str, WeightAck]) -> float | None:
        """The largest error among ``acks`` (None: no generator scored the probe); raises
        `ProbeMismatch` naming the generator and version when one is over the bound."""
        assert self._version == version, "prepare(version) first"
        worst: float | None = None
        for worker, ack in sorted(acks.items()):
            if ack.probe_logprobs is None:
                log.warning("generator %s confirmed weight version %d without scoring the probe", worker, version)
                continue
            if len(ack.probe_logprobs) != len(self._expected):
                raise ProbeMismatch(
                    f"generator {worker} scored {len(ack.probe_logprobs)} probe tokens at weight version {version}; "
                    f"the probe has {len(self._expected)}"
                )
            error = sum(abs(a - b) for a, b in zip(ack.probe_logprobs, self._expected, strict=True)) / max(
                1, len(self._expected)
            )
            if error > self.bound:
                raise ProbeMismatch(
                    f"generator {worker} at weight version {version} scores the probe {error:.4f} nats per token "
                    f"away from the trainer (refit.max_probe_error {self.bound}): it serves other weights than "
                    "the trainer sent"
                )
            worst = error if worst is None else max(worst, error)
        return worst


def build_probe(cfg: RunConfig, score: Callable[[list[int]], Awaitable[list[float]]]) -> RefitProbe | None:
    """The run's probe (``refit.probe_tokens`` of them; None when 0), scored by ``score``."""
    if cfg.refit.probe_tokens <= 0:
        return None
    return RefitProbe(probe_tokens(cfg.policy.tokenizer_path, cfg.refit.probe_tokens), score, cfg.refit.max_probe_error)

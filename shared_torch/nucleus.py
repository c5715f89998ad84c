"""The nucleus (top-p) truncation as vLLM's sampler applies it, shared by the transformers engine
(which samples with it) and the trainer (which scores sampled tokens under it, `sampled_logprobs`).

vLLM's rule: sort the logits ascending, take the softmax's cumulative sum, and drop every token
whose cumulative mass is <= 1 - top_p; the most likely token is never dropped. Works on any
leading shape ([..., V]); the mask is computed without gradient, the kept logits keep theirs.
"""

from __future__ import annotations

import torch


def top_p_mask(logits: torch.Tensor, top_p: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` with the tokens outside the nucleus set to -inf. ``keep`` (ids of shape
    ``logits.shape[:-1]``) names a token per position that stays in whatever its mass: the trainer
    scores tokens the engine sampled, which its own arithmetic may put a hair outside."""
    if top_p >= 1.0:
        return logits
    with torch.no_grad():
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        if keep is not None:
            drop.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, float("-inf"))


def sampled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float, *, untruncated: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of ``targets`` ([..., T] ids of ``logits``' [..., T, V]) under the distribution they
    were sampled from: the temperature-scaled softmax truncated to the top-p nucleus and
    renormalised, as vLLM's sampler builds it and its processed logprobs describe. The truncation
    belongs to the behaviour policy the importance weights divide by; the target always stays in
    (the trainer's arithmetic may put a boundary token a hair outside the engine's nucleus).

    With ``untruncated`` and ``top_p < 1`` also the same tokens' logprobs under the temperature-only
    softmax (no gradient): what scoring without the truncation gives, a diagnostic of the bias the
    truncation removes. Otherwise the second item is None."""
    if temperature != 1.0:
        logits = logits / temperature
    plain = None
    if untruncated and top_p < 1.0:
        with torch.no_grad():
            plain = torch.gather(torch.log_softmax(logits, dim=-1), -1, targets[..., None]).squeeze(-1)
    logits = top_p_mask(logits, top_p, keep=targets)
    return torch.gather(torch.log_softmax(logits, dim=-1), -1, targets[..., None]).squeeze(-1), plain

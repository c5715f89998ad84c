"""The step runner's losses: plain functions over a micro-batch's tensors that every backend runs.

`micro_batch_loss` is one micro-batch's summed clipped-GRPO loss (`services.trainer.loss`) from
its current logprobs: the pre-update ("old") logprobs (the same pass's, detached, with one
update a step; scored before the updates otherwise), the sequence-level logprob-error mask
(`services.trainer.mismatch`, taken from the old logprobs against the generator's), the
diagnostics that go into the step's totals, and the micro-batch's loss sum, valid tokens and
valid sequences, which the update divides by once its global count is known. `in_order` is the
plain micro-batch schedule (the adapters' `run` without pipeline stages).

    rows -> micro_batch.split -> micro_batch.micro_batch -> adapter.run(on_logits) ->
    adapter.logprobs -> micro_batch_loss -> backward; after the update's last one: normalise by
    the global count, clip, optimizer step (`backend.Backend`)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.trainer import mismatch
from services.trainer.backends.adapter import OnLogits
from services.trainer.backends.micro_batch import MicroBatch, stacked
from services.trainer.backends.step_metrics import StepTotals
from services.trainer.batch import Row
from services.trainer.loss import LossNormalizer, clipped_pg_loss
from shared.sections.grpo import LossSection

# Each micro-batch's loss is a sum; the update divides the gradients once its count is known.
SUMS = LossNormalizer(valid_tokens=1.0, valid_sequences=1.0)


@dataclass
class UpdateSums:
    """An update's loss sum, valid tokens and valid sequences (after sequence masking), on this rank."""

    loss: float = 0.0
    tokens: float = 0.0
    sequences: float = 0.0

    def as_list(self) -> list[float]:
        return [self.loss, self.tokens, self.sequences]


def in_order(
    model: torch.nn.Module,
    mbs: list[MicroBatch],
    logits_of: Callable[[torch.nn.Module, MicroBatch], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    on_logits: OnLogits,
    *,
    forward_only: bool,
) -> None:
    """Run ``mbs`` one after the other: logits, ``on_logits``, and its backward pass."""
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for i, mb in enumerate(mbs):
            loss = on_logits(i, mb, logits_of(model, mb))
            if not forward_only:
                backward(loss)


def mask_by_seq_error(
    prev_lp: torch.Tensor, mb: MicroBatch, threshold: float | None, records: list[mismatch.SeqRecord]
) -> torch.Tensor:
    """The micro-batch's sample mask after the sequence-level logprob-error threshold; each row's
    error goes to ``records``."""
    err, n = mismatch.seq_errors(prev_lp, mb.gen_lp, mb.token_mask, mb.sample_mask)
    new = mismatch.apply_threshold(err, mb.sample_mask, threshold)
    for i in range(len(err)):
        masked = bool(mb.sample_mask[i] > 0 and new[i] == 0)
        records.append(mismatch.SeqRecord(float(n[i]), float(err[i]), float(mb.rewards[i]), masked))
    return new


def micro_batch_loss(
    rows: list[Row],
    mb: MicroBatch,
    curr: torch.Tensor,
    *,
    plain: list[torch.Tensor] | None,
    prev: dict[str, torch.Tensor] | None,
    ref_lp: torch.Tensor | None,
    loss_cfg: LossSection,
    seq_error_threshold: float | None,
    acc: StepTotals,
    sums: UpdateSums,
) -> torch.Tensor:
    """The micro-batch's summed loss from its current logprobs ``curr`` (``plain``: without the
    top-p truncation; ``prev``: the old policy's by row key, None for this pass's own); its
    figures go to ``acc``, its loss, valid tokens and valid sequences to ``sums``."""
    acc.shapes.append([len(r.input_ids) for r in rows])
    prev_lp = curr.detach() if prev is None else stacked(prev, rows, torch.zeros_like(curr, dtype=torch.float32))
    sample_mask = mask_by_seq_error(prev_lp, mb, seq_error_threshold, acc.records)
    mask = mb.token_mask * sample_mask[:, None]
    loss, m = clipped_pg_loss(
        curr_lp=curr,
        prev_lp=prev_lp,
        gen_lp=mb.gen_lp,
        advantages=mb.advantages,
        token_mask=mb.token_mask,
        sample_mask=sample_mask,
        cfg=loss_cfg,
        norm=SUMS,
        ref_lp=ref_lp,
    )
    if plain:  # the old policy's logprobs without the truncation, taken at this pass's weights
        m.update(mismatch.untruncated_sums(prev_lp + (plain[0] - curr).detach(), mb.gen_lp, mask))
    # Before the sequence-error threshold: rows a bad refit ruins are the ones it masks.
    fresh = torch.tensor([r.fresh for r in rows], device=curr.device)
    m.update(mismatch.fresh_sums(prev_lp, mb.gen_lp, mb.token_mask * mb.sample_mask[:, None], fresh))
    acc.add(m)
    row_tokens = mask.sum(dim=1)
    sums.loss += float(loss.detach())
    sums.tokens += float(row_tokens.sum())
    sums.sequences += float((row_tokens > 0).sum())
    return loss

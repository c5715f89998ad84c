"""Pipeline stages in the megatron backend (``policy.megatron_cfg.pipeline_model_parallel_size``).

Each stage holds a contiguous run of decoder layers (the first also the embedding, the last the
final norm and the output layer), and megatron-core's own schedule moves each micro-batch through
them: ``get_forward_backward_func`` (one forward, one backward in turn, activations and their
gradients sent between neighbouring stages, shapes too, since rows differ in length). The
training code stays the torch backend's: the schedule calls `_mb_logits` on every stage and hands
the last stage's logits to the same loss (`TorchBackend._micro_batch_loss`), so only the last
stage scores rows. What it computes reaches the other stages where they need it: an update's loss
and token counts (`_sum_over_data`, which the gradient normalisation needs on every stage), the
KL-shaped rewards, and the step's figures (`_global_totals`: rank 0, which reports them, is on
the first stage). Logprobs taken without gradients (the pre-update policy's, the reference's) go
through the same schedule forward only and stay on the last stage, where the loss reads them.

Layers are numbered from 0 on each stage; checkpoints and published weights use the global
numbers (`layer_offset`), so a checkpoint resumes at other pipeline sizes and the HF export is
whole: each stage's ranks deal its tensors among themselves (`stage_ranks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.backends.torch_backend import TorchBackend
from services.trainer.backends.torch_metrics import StepTotals
from services.trainer.batch import Row
from services.trainer.ranks import Ranks

# The last stage's figures for one micro-batch: (index, inputs, logits) -> the loss to backpropagate
OnLogits = Callable[[int, dict[str, Any], torch.Tensor], torch.Tensor]


class PipelineStages(TorchBackend):
    """The torch backend's training loop through pipeline stages (the base of
    `services.trainer.backends.megatron_backend.MegatronBackend`)."""

    # set by `_join_stages`
    pipeline_ranks: Ranks
    stage_ranks: Ranks
    layer_offset: int = 0
    first_stage: bool = True
    last_stage: bool = True

    def _backward_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast state the backward passes need (`MegatronBackend`)."""
        return contextlib.nullcontext()

    @property
    def pipelined(self) -> bool:
        return self.pipeline_ranks.world_size > 1

    def _join_stages(self, num_layers: int) -> None:
        """This rank's stage: its place among the stages, its first layer's global number, and the
        ranks of its stage (every rank joins each stage's group, in order)."""
        from megatron.core import parallel_state

        self.pipeline_ranks = self.ranks.over(parallel_state.get_pipeline_model_parallel_group())
        stage, stages = self.pipeline_ranks.rank, self.pipeline_ranks.world_size
        self.first_stage, self.last_stage = stage == 0, stage == stages - 1
        self.layer_offset = stage * (num_layers // stages)
        if stages == 1:
            self.stage_ranks = self.ranks
            return
        of_rank = [int(s) for s in self.ranks.gather(stage)]
        for s in range(stages):
            group = dist.new_group([r for r, x in enumerate(of_rank) if x == s])
            if s == stage:
                self.stage_ranks = self.ranks.over(group)

    def _pipeline(
        self,
        model: torch.nn.Module,
        mbs: list[list[Row] | None],
        filler: Row,
        on_logits: OnLogits,
        *,
        forward_only: bool,
    ) -> None:
        """Run ``mbs`` (None: a filler pass) through the stages with megatron-core's schedule;
        ``on_logits`` gives the last stage's loss of each (and keeps what it needs)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        inputs = [self._inputs(rows if rows is not None else [filler]) for rows in mbs]

        def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            i = next(data_iterator)

            def loss(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                # the model's config has calculate_per_token_loss: the schedule keeps our sums as
                # they are (one "token" a micro-batch is only its count)
                return on_logits(i, inputs[i], output), torch.ones((), dtype=torch.int), {}

            return self._mb_logits(chunk, inputs[i]), loss

        widths = [mb["pack"][0].shape[1] if "pack" in mb else mb["input_ids"].shape[1] for mb in inputs]
        with torch.no_grad() if forward_only else self._backward_autocast():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(range(len(mbs))),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=max(widths),  # shapes travel with each activation (variable_seq_lengths)
                micro_batch_size=max(len(mb["input_ids"]) for mb in inputs),
                forward_only=forward_only,
            )

    def _accumulate(
        self,
        rows: list[Row],
        prev: dict[str, torch.Tensor] | None,
        acc: StepTotals,
        filler: Row,
    ) -> list[float]:
        """The torch backend's micro-batch loop through the pipeline: the last stage scores each
        micro-batch with the same loss; the other stages' figures stay zero."""
        if not self.pipelined:
            return super()._accumulate(rows, prev, acc, filler)
        mbs = self._in_step(self._micro_batches(rows, self.policy.train_micro_batch_size))
        ref = self._rows_logprobs(self.ref_model, rows, filler) if self._kl_in_loss else None
        sums = [0.0, 0.0, 0.0]

        def score(i: int, mb: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
            plain: list[torch.Tensor] | None = [] if self.top_p < 1.0 else None
            curr = self._logprobs_of(logits, mb, plain)
            mb_rows = mbs[i]
            if mb_rows is None:
                return curr.sum() * 0.0
            ref_lp = None if ref is None else self._stack(ref, mb_rows, curr.shape)
            return self._micro_batch_loss(mb_rows, mb, curr, plain, prev, ref_lp, acc, sums)

        self._pipeline(self.model, mbs, filler, score, forward_only=False)
        return sums

    def _rows_logprobs(self, model: torch.nn.Module, rows: list[Row], filler: Row) -> dict[str, torch.Tensor]:
        """Each row's logprobs, forward only through the pipeline: on the last stage (empty on
        the others, which never read them)."""
        if not self.pipelined:
            return super()._rows_logprobs(model, rows, filler)
        mbs = self._in_step(self._micro_batches(rows, self.policy.train_micro_batch_size))
        out: dict[str, torch.Tensor] = {}

        def keep(i: int, mb: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
            lp = self._logprobs_of(logits, mb)
            for r, row_lp in zip(mbs[i] or [], lp, strict=False):
                out[r.key] = row_lp[: len(r.input_ids)].clone()
            return lp.sum() * 0.0

        self._pipeline(model, mbs, filler, keep, forward_only=True)
        return out

    def _sequence_kl(self, rows: list[Row], filler: Row) -> tuple[dict[str, float], float, float]:
        """The KL sums of the rows, taken on the last stage and shared with the other stages."""
        if not self.pipelined:
            return super()._sequence_kl(rows, filler)
        lp, ref = self._rows_logprobs(self.model, rows, filler), self._rows_logprobs(self.ref_model, rows, filler)
        mine = self._kl_sums(rows, lp, ref) if self.last_stage else None
        result: tuple[dict[str, float], float, float] = self.pipeline_ranks.gather(mine)[-1]
        return result

    def _sum_over_data(self, values: list[float]) -> list[float]:
        """Summed over the stages first (only the last one scored the rows), then the data ranks."""
        return self.data_ranks.all_sum(self.pipeline_ranks.all_sum(values))

    def _global_totals(self, acc: StepTotals) -> StepTotals:
        """The last stage's totals (over its data ranks) on every stage."""
        acc = super()._global_totals(acc)
        if not self.pipelined:
            return acc
        last: StepTotals = self.pipeline_ranks.gather(acc)[-1]
        return last

"""Pipeline stages in the megatron backend (``policy.megatron_cfg.pipeline_model_parallel_size``).

Each stage holds a contiguous run of decoder layers (the first also the embedding, the last the
final norm and the output layer), and megatron-core's own schedule moves each micro-batch through
them: ``get_forward_backward_func`` (one forward, one backward in turn, activations and their
gradients sent between neighbouring stages, shapes too, since rows differ in length). `run` is
the megatron adapter's micro-batch schedule when there are stages: the same step runner's
callback (`services.trainer.backends.adapter.OnLogits`) gets the last stage's logits, so only the
last stage scores rows; what it computes reaches the other stages through the layout's reductions
(`Layout.sum_over_data`, `Layout.from_last_stage`). Passes without gradients (the pre-update
policy's logprobs, the reference's) go through the same schedule forward only and stay on the
last stage, where the loss reads them.

Layers are numbered from 0 on each stage; checkpoints and published weights use the global
numbers (`Layout.layer_offset`), so a checkpoint resumes at other pipeline sizes and the HF export
is whole: each stage's ranks deal its tensors among themselves (`Layout.stage`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from services.trainer.backends.adapter import OnLogits
from services.trainer.backends.micro_batch import MicroBatch


def run(
    model: torch.nn.Module,
    mbs: list[MicroBatch],
    logits_of: Callable[[torch.nn.Module, MicroBatch], torch.Tensor],
    on_logits: OnLogits,
    *,
    forward_only: bool,
    backward_context: contextlib.AbstractContextManager[Any],
) -> None:
    """Run ``mbs`` through the stages with megatron-core's schedule; ``on_logits`` gives the last
    stage's loss of each (and keeps what it needs). ``backward_context``: what the backward passes
    run under (CPU autocast, `megatron_adapter.MegatronAdapter.backward`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        i = next(data_iterator)

        def loss(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            # the model's config has calculate_per_token_loss: the schedule keeps our sums as they
            # are (one "token" a micro-batch is only its count)
            return on_logits(i, mbs[i], output), torch.ones((), dtype=torch.int), {}

        return logits_of(chunk, mbs[i]), loss

    widths = [mb.ids.shape[1] for mb in mbs]
    with torch.no_grad() if forward_only else backward_context:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(len(mbs))),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(widths),  # shapes travel with each activation (variable_seq_lengths)
            micro_batch_size=max(len(mb.input_ids) for mb in mbs),
            forward_only=forward_only,
        )

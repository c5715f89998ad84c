"""The megatron backend's optimizer: AdamW on every rank's parameters (its tensor- and
expert-parallel parts), or with ``policy.megatron_cfg.optimizer.use_distributed_optimizer`` its
state sharded over the data-parallel ranks.

Sharded, each data-parallel rank owns a share of the parameters (torch's
``ZeroRedundancyOptimizer``, ZeRO stage 1): it keeps AdamW's moments for those only, steps them
with the gradients every rank already holds reduced, and broadcasts them to the other data ranks.
Dense parameters are shared out over the data-parallel group; experts, which differ between
expert-parallel ranks, over the expert data-parallel group (the ranks holding the same experts).
Two optimizers then run side by side behind one (`Chained`), so that one learning-rate schedule
drives both. What this does not shard, unlike megatron-core's own distributed optimizer: the
float32 master weights and the gradients (every data rank holds its parts whole); its
flat-buffer state has no per-parameter layout for the backend's ranks-independent checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class Chained(torch.optim.Optimizer):  # type: ignore[misc]
    """Several optimizers stepped as one: their param groups are this one's (a scheduler setting
    the learning rate sets it in each)."""

    def __init__(self, inner: list[torch.optim.Optimizer]) -> None:
        params = [p for o in inner for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.inner = inner
        self.param_groups = [g for o in inner for g in o.param_groups]

    def step(self, closure: Any = None) -> None:
        for o in self.inner:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.inner:
            o.zero_grad(set_to_none=set_to_none)


def build(
    params: list[torch.nn.Parameter],
    settings: dict[str, Any],
    *,
    distributed: bool,
    dense_group: Any,
    expert_group: Any,
) -> torch.optim.Optimizer:
    """AdamW over ``params`` (``settings``: its arguments); ``distributed``: sharded as the module
    docstring says over ``dense_group`` (dense parameters) and ``expert_group`` (experts, whose
    megatron ``allreduce`` attribute is false)."""
    if not distributed:
        return torch.optim.AdamW(params, **settings)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    parts: list[torch.optim.Optimizer] = [
        ZeroRedundancyOptimizer(group_params, optimizer_class=torch.optim.AdamW, process_group=group, **settings)
        for group_params, group in ((dense, dense_group), (experts, expert_group))
        if group_params
    ]
    return parts[0] if len(parts) == 1 else Chained(parts)


def owned_states(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.nn.Parameter, dict[str, Any]]]:
    """Each parameter whose AdamW state this rank keeps, with that state (made as zeros when the
    optimizer has not stepped yet, so that a checkpoint load has somewhere to go)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    for part in optimizer.inner if isinstance(optimizer, Chained) else [optimizer]:
        local = part.optim if isinstance(part, ZeroRedundancyOptimizer) else part
        for group in local.param_groups:
            for param in group["params"]:
                state = local.state[param]
                if not state:
                    state.update(
                        step=torch.zeros((), dtype=torch.float32),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )
                yield param, state


def clip_grad_norm(model: torch.nn.Module, max_norm: float, *, sharded: bool, device: torch.device) -> float:
    """Clip ``model``'s gradients by their global norm, returned: tensor-parallel parts summed
    over their group (replicated parameters counted once), experts over the expert-parallel ranks
    (``sharded``: the ranks hold parts of the model)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    dense = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if not getattr(p, "allreduce", True):
            experts += p.grad.double().pow(2).sum()
        elif tensor_parallel.param_is_not_tensor_parallel_duplicate(p):
            dense += p.grad.double().pow(2).sum()
    if sharded:
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        dist.all_reduce(experts, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    norm = float((dense + experts).sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm

"""A NaN put into one parameter's gradient, as backward left it and before the backend reads it:
the non-finite-gradient tests' injection, the same for every model adapter and rank layout."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def poison_gradient(backend: Any, param: str, at_update: int = 0) -> None:
    """At ``backend``'s ``at_update``-th optimizer update from now (0: the next), put a NaN into
    the first element of ``param``'s gradient just before the adapter makes the gradients ready:
    megatron's ``main_grad`` buffer (which its DDP checks and reduces), or the ``.grad`` (a
    DTensor's local shard) that backward left."""
    target = dict(backend.model.named_parameters())[param]
    inner = backend.adapter.grads_ready
    calls = {"n": 0}

    def grads_ready(model: torch.nn.Module) -> None:
        if calls["n"] == at_update:
            grad = getattr(target, "main_grad", None)
            if grad is None:
                grad = target.grad
            assert grad is not None, f"{param} has no gradient to poison"
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            with torch.no_grad():
                local.view(-1)[0] = float("nan")
        calls["n"] += 1
        inner(model)

    backend.adapter.grads_ready = grads_ready


def mlp_weight(backend: Any) -> str:
    """The name of the first layer's first weight with "mlp" in its name (every adapter's model
    has one: transformers' ``mlp.*_proj``, megatron's ``pre_mlp_layernorm`` and ``mlp.linear_fc*``)."""
    return next(n for n, _ in backend.model.named_parameters() if ".0." in n and ("mlp" in n) and n.endswith("weight"))

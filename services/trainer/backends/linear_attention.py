"""Packed rows through linear-attention layers, each row on its own.

A pack lays rows end to end as one sequence (`services.trainer.packing`). Attention layers keep
each row to itself through the position ids (transformers builds a block-diagonal mask from their
resets), but a linear-attention layer (Gated DeltaNet in Qwen3-Next and Qwen3.5: a short causal
convolution, then a recurrent state carried token to token) reads no mask: the convolution window
and the recurrent state would carry the end of one row into the start of the next. The fused
kernels take per-row offsets (``cu_seqlens``), but transformers' pure-torch reference kernels, which
run wherever flash-linear-attention cannot (CPU), ignore them.

`separate_rows` wraps the forward of every linear-attention module of a model once (modules named
``*.linear_attn``, as transformers names them, or the modules given); inside ``rows_apart(starts)``
a wrapped module given a whole pack runs each row's slice alone, from a zero state, and joins the
outputs, the same computation as the row's unpacked forward. Outside it, or for a batch of padded
rows, the module runs as it was. Used by the transformers adapter
(`services.trainer.backends.hf_adapter`). megatron-core's ``GatedDeltaNet`` is kept apart one
level lower, at its convolution and its gated delta rule, because with sequence parallelism its
input is only this tensor-parallel rank's part of the sequence
(`services.trainer.backends.megatron_hybrid.separate_rows`, reading `row_bounds`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch

_ROW_BOUNDS: ContextVar[tuple[int, ...] | None] = ContextVar("_ROW_BOUNDS", default=None)


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear-attention modules (a decoder layer's ``linear_attn``)."""
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "linear_attn"]


def separate_rows(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> int:
    """Wrap each linear-attention module's forward (``modules``, by default the model's
    `linear_attention_modules`; input [B, T, H]) to honour `rows_apart`; the number wrapped.
    Wrapping twice changes nothing."""
    modules = linear_attention_modules(model) if modules is None else modules
    for module in modules:
        if not getattr(module, "_streamrl_rows_apart", False):
            module.forward = _row_by_row(module.forward)
            module._streamrl_rows_apart = True
    return len(modules)


@contextlib.contextmanager
def rows_apart(starts: Sequence[int], total: int) -> Iterator[None]:
    """Within the block, a pack of ``total`` tokens whose rows start at ``starts`` goes through the
    wrapped modules one row at a time."""
    token = _ROW_BOUNDS.set((*starts, total))
    try:
        yield
    finally:
        _ROW_BOUNDS.reset(token)


def row_bounds(length: int) -> tuple[int, ...] | None:
    """Inside `rows_apart` for a pack of ``length`` tokens of more than one row: its row starts,
    then its end; otherwise None (run as one sequence)."""
    bounds = _ROW_BOUNDS.get()
    if bounds is None or len(bounds) <= 2 or bounds[-1] != length:
        return None
    return bounds


def _row_by_row(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        bounds = row_bounds(hidden.shape[1])
        if bounds is None or hidden.shape[0] != 1:
            return forward(*args, **kwargs)
        if kwargs.get("cache_params") is not None:
            raise RuntimeError("a pack cannot run with a generation cache")
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        mask = rest.pop("attention_mask", None)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            row_mask = _row_mask(mask, start, end)
            outs.append(forward(hidden[:, start:end], *args[1:], attention_mask=row_mask, **rest))
        return torch.cat(outs, dim=1)

    return wrapped


def _row_mask(mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """A row's part of a padding mask ([B, T]) or of megatron's attention mask ([1, 1, T, T])."""
    if mask is None:
        return None
    return mask[..., start:end, start:end] if mask.dim() == 4 else mask[:, start:end]

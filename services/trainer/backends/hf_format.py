"""The transformers model's tensors under the checkpoint's names, and the checkpoint's tensors the
model does not hold.

transformers 5 loads some checkpoints into other shapes than it stores them: routed experts
stored one by one (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``) become fused
parameters (``mlp.experts.gate_up_proj`` [E, 2F, H], ``mlp.experts.down_proj`` [E, H, F]).
Published weights must be what a generator loads from a checkpoint of that model (vLLM's loaders
and ``from_pretrained`` read the stored names), so `as_stored` turns each state-dict tensor back
with transformers' own reverse conversion, one tensor at a time, as the weights stream out.

Some stored tensors are never loaded at all: the multi-token-prediction (MTP) module of Qwen3-Next
and Qwen3.5 (``mtp.*``) is dropped by transformers' model and trained by nobody here, yet a
generator that drafts with it needs it. `untrained` names them, and the transformers adapter
copies them, unchanged, from the run's starting checkpoint into every published version
(`services.trainer.backends.hf_adapter`), so they survive every refit and checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


def as_stored(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (state-dict name, tensor) as the checkpoint stores it (one or several tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in tensors:
        yield from revert_weight_conversion(model, {name: tensor}).items()


def stored_names(model: torch.nn.Module, skip: frozenset[str]) -> list[tuple[str, tuple[int, ...]]]:
    """(stored name, shape) of every state-dict tensor but ``skip``, from shapes alone (meta tensors)."""
    meta = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in model.state_dict().items())
    return [(n, tuple(t.shape)) for n, t in as_stored(model, ((n, t) for n, t in meta if n not in skip))]


def untrained(model: torch.nn.Module, files: dict[str, Path]) -> list[str]:
    """The names in the checkpoint ``files`` (name -> file) under a top-level module the model
    does not have (``mtp.*`` beside ``model.*`` and ``lm_head.*``)."""
    held = {n.split(".", 1)[0] for n, _ in stored_names(model, frozenset())}
    return sorted(n for n in files if n.split(".", 1)[0] not in held)


def read_tensors(files: dict[str, Path], names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``names`` read from their files, as stored."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in in_file:
                yield name, f.get_tensor(name)

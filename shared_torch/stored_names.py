"""A transformers model's tensors under the names its checkpoint stores them by, both ways.

transformers 5 loads some checkpoints into other shapes than it stores them: routed experts
stored one by one (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``) become fused
parameters (``mlp.experts.gate_up_proj`` [E, 2F, H], ``mlp.experts.down_proj`` [E, H, F]). What a
trainer publishes and a generator loads are the stored names (vLLM's loaders and
``from_pretrained`` read those), so:

* `as_stored` turns (state-dict name, tensor) pairs into stored ones with transformers' own
  reverse conversion, one tensor at a time, as the weights stream out (the trainer);
* `StoredLayout` places stored tensors back into a live model's parameters (the transformers
  generator engine). Where a parameter is converted, the reverse conversion of a tensor of its
  element indices says which element each stored element came from, whatever the conversion
  (split, stack, transpose), so nothing restates transformers' rules.

Modules a checkpoint has and the model does not are `foreign`: carried, never loaded. They are
what lies outside the modules the model's stored names live under: the MTP module (``mtp.*``,
which transformers drops) beside ``model.*``, and in a multimodal checkpoint whose language model
the causal LM is (Qwen3.5's ``Qwen3_5MoeForConditionalGeneration``, stored as
``model.language_model.*``), the vision tower ``model.visual.*`` too. ``from_pretrained`` records
how the checkpoint's names became the model's (``model.language_model.`` -> ``model.``, experts
fused), and `as_stored` reverses exactly that; a model built from its config instead (the
trainer's sharded load) is given the same record by `follow_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def as_stored(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (state-dict name, tensor) as the checkpoint stores it (one or several tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in tensors:
        yield from revert_weight_conversion(model, {name: tensor}).items()


def stored_names(model: torch.nn.Module, skip: frozenset[str] = frozenset()) -> list[tuple[str, tuple[int, ...]]]:
    """(stored name, shape) of every state-dict tensor but ``skip``, from shapes alone (meta tensors)."""
    meta = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in model.state_dict().items())
    return [(n, tuple(t.shape)) for n, t in as_stored(model, ((n, t) for n, t in meta if n not in skip))]


def held_modules(model: torch.nn.Module) -> set[str]:
    """The checkpoint modules the model holds: for each of its top-level modules, the module its
    stored names share (``model`` and ``lm_head`` for a text checkpoint; ``model.language_model``
    and ``lm_head`` for a multimodal one, whose ``model.visual`` the causal LM does not hold)."""
    shared: dict[str, list[str]] = {}
    for name, tensor in model.state_dict().items():
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        top = name.split(".", 1)[0]
        for stored, _ in as_stored(model, [(name, meta)]):
            path = stored.split(".")[:-1]
            shared[top] = _common(shared.get(top, path), path)
    return {".".join(path) or top for top, path in shared.items()}


def _common(a: list[str], b: list[str]) -> list[str]:
    """The leading components of two module paths that they share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def foreign(model: torch.nn.Module, names: Iterable[str]) -> list[str]:
    """``names`` under no module the model holds (`held_modules`): ``mtp.*`` beside ``model.*``,
    and ``model.visual.*`` beside ``model.language_model.*``."""
    held = tuple(module + "." for module in held_modules(model))
    return sorted(n for n in names if not n.startswith(held))


def follow_checkpoint(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Record on ``model``, built from its config, the conversions that loading a checkpoint of
    ``names`` with ``from_pretrained`` would have used and recorded (transformers keeps those
    that matched a stored name), so that `as_stored` gives that checkpoint's names: a multimodal
    checkpoint's ``model.language_model.`` prefix, experts fused or one by one as stored."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    for name in names:
        for conversion in conversions:
            conversion.rename_source_key(name)  # marks the conversion used when it matches
    model._weight_conversions = [c for c in conversions if c.was_used()]


class StoredLayout:
    """Where each stored tensor of ``model`` goes: a parameter whole, or elements of a converted
    (fused) one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._state = model.state_dict()
        self._places: dict[str, tuple[str, torch.Tensor | None]] = {}
        for name, tensor in self._state.items():
            meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            [(first, shape), *rest] = [(n, t.shape) for n, t in as_stored(model, [(name, meta)])]
            if not rest and first == name and shape == tensor.shape:
                self._places[name] = (name, None)
                continue
            index = torch.arange(tensor.numel()).view(tensor.shape)
            for stored, elements in as_stored(model, [(name, index)]):
                self._places[stored] = (name, elements.clone())

    @property
    def names(self) -> set[str]:
        return set(self._places)

    def shape(self, stored: str) -> tuple[int, ...]:
        name, elements = self._places[stored]
        return tuple(self._state[name].shape if elements is None else elements.shape)

    def copy_(self, stored: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (a stored tensor) into its place; under ``torch.no_grad``."""
        name, elements = self._places[stored]
        target = self._state[name]
        if elements is None:
            target.copy_(tensor)
        else:
            target.view(-1)[elements.reshape(-1)] = tensor.reshape(-1).to(target.dtype)

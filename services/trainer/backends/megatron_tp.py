"""Where the megatron backend's parameters live across ranks, and how they are cut, gathered and
checkpointed.

megatron-core splits a tensor-parallel layer's weight along its ``partition_dim`` (attributes it
sets on the parameter): column-parallel layers (``linear_qkv``, ``linear_fc1``, the vocabulary
embedding and ``output_layer``) by rows, row-parallel ones (``linear_proj``, ``linear_fc2``) by
columns; norms (the QK norms too) are replicated. The fused QKV matrix is ordered by query group,
so rank ``r``'s rows are whole groups and the ranks' rows concatenate to the one-rank matrix. The
gated ``linear_fc1`` is not: each rank holds [its rows of gate; its rows of up], so cutting and
gathering it goes through the halves (`local_part`, `gather_full`); so do Gated DeltaNet's fused
``in_proj`` and ``conv1d`` (Qwen3.5), through the parts `megatron_hybrid.FUSED_PARTS` names on
them. Experts are cut by their own
(expert) tensor-parallel group, which is one rank here (``expert_tensor_parallel_size`` 1), and
split between expert-parallel ranks whole (`services.trainer.backends.megatron_moe`).

Checkpoints are torch Distributed Checkpoints in a layout that does not depend on the ranks
(`checkpoint_tensors`): each tensor-parallel weight is a DTensor sharded over its group (every rank
writes its part; data-parallel replicas are written once), the gated ``linear_fc1`` is kept as its
gate and up halves (fused Gated DeltaNet weights as their parts), and local experts are named by
their global expert id. So a checkpoint written at one tensor-, expert- or data-parallel size
resumes at another, as the torch backend's do.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.backends.megatron_hybrid import FUSED_PARTS, conv_parts, in_proj_parts

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _parts(name: str, param: torch.nn.Parameter, t: torch.Tensor, dim: int) -> list[int] | None:
    """The sizes of the parts ``t`` (``param`` whole or one rank's part of it) is fused from along
    ``dim``, each split over the tensor-parallel ranks on its own: the gate and up halves of a
    SwiGLU MLP's ``linear_fc1``, or the parts `FUSED_PARTS` names; None for an unfused weight."""
    whole: tuple[int, ...] | None = getattr(param, FUSED_PARTS, None)
    if whole is None:
        return [t.shape[dim] // 2] * 2 if name.endswith("linear_fc1.weight") else None
    return [size * t.shape[dim] // sum(whole) for size in whole]


def tp_group_of(param: torch.nn.Parameter) -> Any:
    """The process group ``param`` is split over (None: whole on every rank that has it)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return None
    expert = not getattr(param, "allreduce", True)
    group = (
        parallel_state.get_expert_tensor_parallel_group()
        if expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    return group if dist.get_world_size(group) > 1 else None


def local_part(full: torch.Tensor, param: torch.nn.Parameter, name: str) -> torch.Tensor:
    """This rank's part of the whole tensor ``full`` for ``param`` (``full`` itself when whole)."""
    group = tp_group_of(param)
    if group is None or tuple(full.shape) == tuple(param.shape):
        return full
    dim = param.partition_dim
    return _cut(full, dist.get_world_size(group), dist.get_rank(group), dim, _parts(name, param, full, dim))


def _cut(full: torch.Tensor, n: int, r: int, dim: int, parts: list[int] | None) -> torch.Tensor:
    """Rank ``r`` of ``n``'s part of ``full`` along ``dim``, fused ``parts`` each cut on its own."""
    if parts is not None:
        return torch.cat([part.chunk(n, dim)[r] for part in full.split(parts, dim)], dim)
    return full.chunk(n, dim)[r]


# How the backend's tensor-parallel layers split, by megatron name, where no model is at hand (a
# layout planned for ranks that do not exist here: `services.trainer.reshard_plan`). megatron-core
# sets the same on the parameters it builds (``partition_dim``), which `local_part` reads; the
# tensor-parallel tests check that `cut` agrees with it.
_COLUMN_PARALLEL = (
    "linear_qkv.weight",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
    "self_attention.in_proj.weight",
    "self_attention.conv1d.weight",
    "self_attention.A_log",
    "self_attention.dt_bias",
)
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight", "self_attention.out_proj.weight")


def cut(full: torch.Tensor, name: str, hf: dict[str, Any], n: int, r: int) -> torch.Tensor:
    """Tensor-parallel rank ``r`` of ``n``'s part of the whole megatron tensor ``name`` of a model
    of HF config ``hf``, as `local_part` cuts it on a live model; replicated tensors and experts
    (expert tensor-parallel size 1) whole."""
    if n == 1 or ".local_experts." in name:
        return full
    if name.endswith(_COLUMN_PARALLEL):
        dim = 0
    elif name.endswith(_ROW_PARALLEL):
        dim = 1
    else:
        return full
    parts: list[int] | None = None
    if name.endswith("linear_fc1.weight"):
        parts = [full.shape[0] // 2] * 2
    elif name.endswith("self_attention.in_proj.weight"):
        parts = list(in_proj_parts(hf))
    elif name.endswith("self_attention.conv1d.weight"):
        parts = list(conv_parts(hf))
    return _cut(full, n, r, dim, parts)


def gather_full(local: torch.Tensor, param: torch.nn.Parameter, name: str) -> torch.Tensor:
    """The whole tensor of ``param`` from every rank's part (collective over its group)."""
    group = tp_group_of(param)
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim = param.partition_dim
    sizes = _parts(name, param, local, dim)
    if sizes is not None:
        split = [p.split(sizes, dim) for p in parts]
        return torch.cat([s[j] for j in range(len(sizes)) for s in split], dim)
    return torch.cat(parts, dim)


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The shape `gather_full` gives ``param`` (no collective)."""
    shape = list(param.shape)
    group = tp_group_of(param)
    if group is not None:
        shape[param.partition_dim] *= dist.get_world_size(group)
    return tuple(shape)


def global_expert_name(name: str, first_expert: int) -> str:
    """A local expert's parameter name with its global expert id (``first_expert`` is this
    expert-parallel rank's first)."""
    return _LOCAL_EXPERT.sub(lambda m: f".experts.{first_expert + int(m.group(1))}.", name)


def renumber(name: str, offset: int) -> str:
    """A decoder-layer parameter name with its layer number moved by ``offset`` (a pipeline
    stage's layers are numbered from 0; ``offset`` is its first layer's global number)."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _part_keys(key: str, count: int) -> list[str]:
    """The checkpoint names of a fused weight's parts (a SwiGLU ``linear_fc1``: gate and up)."""
    return [key + ".gate", key + ".up"] if count == 2 else [f"{key}.part{j}" for j in range(count)]


class CheckpointLayout:
    """Views of a module's parameters (and of tensors shaped like them: optimizer moments) in the
    checkpoint layout described above. The views share storage with what they view, so a
    Distributed Checkpoint load writes straight into the parameters."""

    def __init__(self, module: torch.nn.Module, first_expert: int, device_type: str, *, layer_offset: int = 0) -> None:
        self.params = dict(module.named_parameters())
        self.first_expert = first_expert
        self.layer_offset = layer_offset
        self.device_type = device_type
        self._meshes: dict[Any, Any] = {}

    def views(self, name: str, t: torch.Tensor, *, copy: bool = False) -> dict[str, torch.Tensor]:
        """``t`` (parameter ``name`` or a tensor of its shape) under its checkpoint names (copies
        of its parts with ``copy``)."""
        from torch.distributed.tensor import DTensor, Shard

        param = self.params[name]
        group = tp_group_of(param)
        dim = param.partition_dim if group is not None else 0
        key = self.key(name)
        parts = _parts(name, param, t, dim)
        pieces = {key: t} if parts is None else dict(zip(_part_keys(key, len(parts)), t.split(parts, dim), strict=True))
        if copy:
            pieces = {k: v.detach().clone() for k, v in pieces.items()}
        if group is None:
            return pieces
        mesh = self._mesh(group)
        return {k: DTensor.from_local(v, mesh, [Shard(dim)], run_check=False) for k, v in pieces.items()}

    def key(self, name: str) -> str:
        """Parameter ``name``'s checkpoint name: global expert id, global layer number."""
        return renumber(global_expert_name(name, self.first_expert), self.layer_offset)

    def _mesh(self, group: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if group not in self._meshes:
            self._meshes[group] = DeviceMesh.from_group(group, self.device_type)
        return self._meshes[group]


def checkpoint_tensors(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: CheckpointLayout, *, copy: bool = False
) -> dict[str, Any]:
    """The model's parameters and the AdamW state this rank keeps (every parameter's, or with a
    sharded optimizer the ones it owns: each is written by its owner) as checkpoint views (copies
    with ``copy``, for a write that goes on while training changes them)."""
    from services.trainer.backends.megatron_optim import owned_states

    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in layout.params.items()}
    for name, param in layout.params.items():
        model.update(layout.views(name, param.data, copy=copy))
    for param, state in owned_states(optimizer):
        name = names[id(param)]
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == param.shape:
                optim.update({f"{key}/{k}": view for key, view in layout.views(name, v, copy=copy).items()})
            elif torch.is_tensor(v):
                optim[f"{layout.key(name)}/{k}"] = v.clone() if copy else v
    return {"model": model, "optimizer": optim}

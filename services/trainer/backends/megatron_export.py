"""The megatron backend's weights in Hugging Face naming, whole, a layer at a time: for the files a
refit writes and for the tensors a collective refit sends.

`stage_tensors` walks one pipeline stage's parameters (its layers under their global numbers),
gathering each tensor-parallel part and the other expert-parallel ranks' experts (collective over
the stage's groups: every rank of the stage walks it), converts each layer to HF names and drops
the vocabulary padding. With ``meta`` it walks the same names and shapes on the meta device,
without moving a byte: `stage_metadata` is that walk, so every rank knows the whole policy's
tensors (name, shape, in order) before any is sent.

`to_first_rank` is the collective refit's stream: the policy on global rank 0, stage after stage.
Stage 0's tensors are rank 0's own; each later stage's are sent to rank 0, tensor by tensor, by
that stage's rank in rank 0's pipeline group, while every other rank walks its stage for the
gathers it joins. So no rank holds more than a layer beyond its own parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.backends import megatron_tp
from services.trainer.backends.megatron_convert import TEXT_PREFIX, megatron_globals_to_hf, megatron_layer_to_hf
from services.trainer.ranks import Ranks

# Parameters with a row per vocabulary entry (padded to `padded_vocab`).
VOCAB_ROWS = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})

Meta = list[tuple[str, tuple[int, ...]]]


def stage_tensors(
    module: torch.nn.Module,
    hf: dict[str, Any],
    *,
    layer_offset: int,
    num_layers: int,
    vocab: int,
    ep_size: int,
    meta: bool = False,
    prefix: str = TEXT_PREFIX,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's ``num_layers`` layers (the first numbered ``layer_offset``) and the globals it
    holds, in HF naming (the language model's ``model.*`` under ``prefix``, as the checkpoint
    stores it), each tensor whole (on the meta device with ``meta``)."""
    params = dict(module.named_parameters())

    def whole(name: str, p: torch.nn.Parameter) -> torch.Tensor:
        if meta:
            return torch.empty(megatron_tp.full_shape(p), dtype=p.dtype, device="meta")
        return megatron_tp.gather_full(p.detach(), p, name)

    outside_layers = {}
    for n, p in params.items():
        if not n.startswith("decoder.layers."):
            full = whole(n, p)
            outside_layers[n] = full[:vocab] if n in VOCAB_ROWS else full
    yield from megatron_globals_to_hf(outside_layers, prefix).items()
    for j in range(num_layers):
        layer = f"decoder.layers.{j}."
        mine = {megatron_tp.renumber(n, layer_offset): whole(n, p) for n, p in params.items() if n.startswith(layer)}
        per_rank = [dict(mine) for _ in range(ep_size)] if meta else every_expert_rank(mine, ep_size)
        for ep_rank, state in enumerate(per_rank):
            for name, tensor in megatron_layer_to_hf(
                state, hf, layer_offset + j, ep_rank=ep_rank, ep_size=ep_size, prefix=prefix
            ).items():
                if ep_rank == 0 or ".mlp.experts." in name:  # the rest is every rank's alike
                    yield name, tensor


def every_expert_rank(state: dict[str, torch.Tensor], ep_size: int) -> list[dict[str, torch.Tensor]]:
    """A layer's whole tensors as each expert-parallel rank holds them (its experts, and the rest,
    which every rank holds alike): the other ranks' experts all-gathered."""
    if ep_size == 1:
        return [state]
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    per_rank: list[dict[str, torch.Tensor]] = [dict(state) for _ in range(ep_size)]
    for name in sorted(n for n in state if ".local_experts." in n):
        parts = [torch.empty_like(state[name]) for _ in range(ep_size)]
        dist.all_gather(parts, state[name].contiguous(), group=group)
        for r in range(ep_size):
            per_rank[r][name] = parts[r]
    return per_rank


def stage_metadata(stage_walk: Iterator[tuple[str, torch.Tensor]], pipeline: Ranks) -> list[Meta]:
    """Each stage's HF tensors (name, shape) in walking order, from every stage's meta walk
    (``stage_walk``: `stage_tensors` with ``meta``), on every rank."""
    mine = [(name, tuple(t.shape)) for name, t in stage_walk]
    stages: list[Meta] = pipeline.gather(mine)
    return stages


def to_first_rank(
    own: Iterator[tuple[str, torch.Tensor]],
    stages: list[Meta],
    pipeline: Ranks,
    dtype: torch.dtype,
    *,
    is_first_rank: bool,
    in_first_ranks_pipeline: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole policy, as ``dtype`` on the CPU, yielded on global rank 0 (nothing elsewhere):
    ``own`` is this rank's walk of its stage (`stage_tensors`), ``stages`` every stage's metadata.
    Every rank must drain it."""
    stage = pipeline.rank
    if is_first_rank:
        for name, t in own:
            yield name, t.detach().to(dtype=dtype, device="cpu").contiguous()
        for source in range(1, len(stages)):
            for name, shape in stages[source]:
                buf = torch.empty(shape, dtype=dtype, device=pipeline.device)
                dist.recv(buf, group_src=source, group=pipeline.group)
                yield name, buf.cpu()
        return
    for _name, t in own:
        if in_first_ranks_pipeline and stage > 0:
            dist.send(t.detach().to(dtype=dtype).contiguous(), group_dst=0, group=pipeline.group)

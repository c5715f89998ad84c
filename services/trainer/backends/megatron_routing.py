"""MoE routing replay (R3) on the megatron backend: megatron-core's routers route each token to the
experts the generator routed it to (``policy.moe_routing_replay``; the transformers side and the
routes themselves: `services.trainer.backends.routing_replay`).

megatron-core's ``TopKRouter`` takes its experts from ``moe_utils.topk_routing_with_score_function``,
which asks the router's ``router_replay``, when it has one, for the top k of its scores
(``get_replay_topk``). `MegatronReplay` gives every MoE router of this pipeline stage one
(`attach`): the router's own top k, then, for the tokens whose route is known, the generator's
expert ids and the scores at them (`routing_replay.replayed_experts`, the merge both backends
share). The weights therefore follow megatron's own routing path, and are the torch backend's:
with renormalisation (Qwen3-MoE's ``norm_topk_prob``, Qwen3.5) the scores are the logits and
megatron takes the softmax of the k gathered ones, which is the softmax over all experts at those
experts renormalised over the k; without it the scores are the softmax over all experts, gathered.
The router learns through the gathered scores. megatron-core's own ``RouterReplay`` (config
``moe_enable_routing_replay``) is not used: it replays whole top-k tensors from a process-wide
registry of layers, with no tokens left to the router.

Token order: megatron runs sequence-first, so a router sees its hidden states [s, b, h] as s x b
tokens (token ``s * rows + b``), where `MicroBatch.routes` are row-major (``b * T + s``); the
sequence is padded to a multiple of the tensor-parallel ranks under sequence parallelism (pad
positions route as the router chooses) and each tensor-parallel rank's router sees only its
contiguous part of it (`rank_routes`). A pipeline stage's routers take the routes of its own MoE
layers. Under expert parallelism the router runs before the dispatch, on the rank's own tokens.
The adapter sets the routes before each forward pass (`set`, in
`megatron_adapter.MegatronAdapter.logits`, also per micro-batch inside the pipeline schedule); no
activation recomputation is configured, so the backward passes never route again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.trainer.backends.layout import Layout
from services.trainer.backends.micro_batch import MicroBatch
from services.trainer.backends.routing_replay import replayed_experts, replayed_layers

TopK = Callable[[torch.Tensor, int, int | None, int | None], tuple[torch.Tensor, torch.Tensor]]


class MegatronReplay:
    """The generator's routes of the next forward pass on this rank, replayed by this pipeline
    stage's MoE routers in every model attached (the policy, the frozen reference)."""

    def __init__(self, hf: dict[str, Any], layout: Layout, *, sequence_parallel: bool) -> None:
        """``hf``: the language model's HF config (a model without routed experts is refused);
        ``sequence_parallel``: each tensor-parallel rank routes its part of the sequence."""
        from megatron.core import parallel_state

        layers = replayed_layers(hf)
        stage = range(layout.layer_offset, layout.layer_offset + hf["num_hidden_layers"] // layout.pipeline.world_size)
        self.first = sum(layer < stage.start for layer in layers)  # the stage's first MoE layer in the routes
        # this stage's MoE decoder layers (global numbers) -> their index in the stage's routes
        self.index = {layer: i - self.first for i, layer in enumerate(layers) if layer in stage}
        self.layer_offset = layout.layer_offset
        self.part = (0, 1)  # this rank's part of the sequence: (rank, parts)
        if sequence_parallel:
            self.part = (
                int(parallel_state.get_tensor_model_parallel_rank()),
                int(parallel_state.get_tensor_model_parallel_world_size()),
            )
        self.routes: torch.Tensor | None = None  # [tokens, stage's MoE layers, top_k], megatron's order
        self.known: torch.Tensor | None = None  # [tokens] bool

    def attach(self, model: torch.nn.Module) -> None:
        """Replay the routes set here in the routers of ``model`` (this stage's GPTModel)."""
        decoder = model.decoder.layers
        found = {self.layer_offset + j: x.mlp.router for j, x in enumerate(decoder) if hasattr(x.mlp, "router")}
        if found.keys() != self.index.keys():
            raise ValueError(f"the model's MoE layers {sorted(found)} are not the routes' {sorted(self.index)}")
        for layer, router in found.items():
            router.router_replay = _LayerReplay(self, self.index[layer])

    def set(self, mb: MicroBatch, width: int) -> None:
        """``mb``'s routes for its next forward pass, over its sequence padded to ``width``
        positions, as this rank's routers see its tokens (None: every router chooses)."""
        if mb.routes is None or mb.routes_known is None:
            self.routes = self.known = None
            return
        rows, length = mb.ids.shape
        stage = mb.routes[:, self.first : self.first + len(self.index)]
        self.routes, self.known = rank_routes(stage, mb.routes_known, rows, length, width, *self.part)


def rank_routes(
    routes: torch.Tensor, known: torch.Tensor, rows: int, length: int, width: int, rank: int = 0, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes [rows * length, layers, top_k] and whether each is known [rows * length], row-major
    (`MicroBatch.routes`), in megatron's order on part ``rank`` of ``parts`` of the sequence padded
    to ``width``: its token ``s * rows + b`` is position ``rank * width / parts + s`` of row ``b``
    (pad positions unknown)."""
    part = width // parts
    first = rank * part
    n = max(0, min(part, length - first))  # the part's positions that are not padding
    ids = routes.new_zeros((part, rows, *routes.shape[1:]))
    seen = known.new_zeros((part, rows))
    ids[:n] = routes.unflatten(0, (rows, length))[:, first : first + n].transpose(0, 1)
    seen[:n] = known.unflatten(0, (rows, length))[:, first : first + n].transpose(0, 1)
    return ids.flatten(0, 1), seen.flatten(0, 1)


class _LayerReplay:
    """One MoE layer's ``router_replay``: the router's own top k, with the generator's experts
    (and the scores at them) where a token's route is known."""

    def __init__(self, replay: MegatronReplay, layer: int) -> None:
        self.replay, self.layer = replay, layer

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, groups: int | None, group_topk: int | None, own_topk: TopK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, chosen = own_topk(scores, topk, groups, group_topk)
        routes, known = self.replay.routes, self.replay.known
        if routes is None or known is None:
            return values, chosen
        experts = replayed_experts(routes, known, self.layer, chosen)
        return scores.gather(1, experts), experts

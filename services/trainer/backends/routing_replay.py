"""MoE routing replay (R3) for a transformers model: the trainer routes each token to the experts
the generator routed it to.

With ``policy.moe_routing_replay`` every training row carries the generator's routes of its
positions (`services.trainer.batch.Row.routes`, flattened per micro-batch as the forward pass
orders its tokens: `services.trainer.backends.micro_batch.MicroBatch.routes`). An MoE router here
returns (logits, top-k weights, top-k expert ids); `RouterReplay` wraps the router of every MoE
layer so that, where a token's route is known, the expert ids are the generator's and the weights
are the router's own softmax probabilities at those experts (renormalised over the top k when the
router renormalises), so the router still learns through them. Where no route is known the router
chooses as before. Supported: routers that take the top k of a softmax over their logits (the
Qwen MoE family: Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE); anything else is refused when
the model is built.

The routes stay set from one forward pass until the next, so activation checkpointing's
recomputation in the backward pass routes as the forward did. One `RouterReplay` serves every
model the adapter builds (the policy and the frozen reference), whichever runs next. Used by the
transformers adapter (`services.trainer.backends.hf_adapter`); `replayed_layers` and
`replayed_experts` are shared with the megatron backend's replay
(`services.trainer.backends.megatron_routing`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shared.config_error import ConfigError
from shared.routes import moe_layers


def replayed_layers(config: dict[str, Any]) -> list[int]:
    """The decoder layers whose routes are replayed (the generator's ``layers`` axis, in order),
    from a Hugging Face config; a model without routed experts is refused."""
    layers = moe_layers(config)
    if not layers:
        raise ConfigError(
            f"policy.moe_routing_replay is on, but the model (model_type {config.get('model_type')!r}) has no "
            "routed experts"
        )
    return layers


def replayed_experts(routes: torch.Tensor, known: torch.Tensor, layer: int, chosen: torch.Tensor) -> torch.Tensor:
    """[tokens, top_k] expert ids of MoE layer ``layer`` (an index of the ``routes`` [tokens,
    layers, top_k]): the generator's where a token's route is ``known``, the router's ``chosen``
    elsewhere."""
    if routes.shape[0] != chosen.shape[0]:
        raise RuntimeError(f"routes for {routes.shape[0]} tokens, the router of layer {layer} saw {chosen.shape[0]}")
    return torch.where(known[:, None], routes[:, layer, :].to(chosen.device), chosen)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of each MoE layer, in layer order (the generator's ``layers`` axis)."""
    decoder = model.model.layers
    found = [decoder[i].mlp.gate for i in replayed_layers(model.config.to_dict())]
    for r in found:
        if not all(hasattr(r, a) for a in ("top_k", "num_experts", "weight")) or not type(r).__name__.endswith(
            "TopKRouter"
        ):
            raise ConfigError(
                f"routing replay takes routers that pick the top k of a softmax (the Qwen MoE family), not "
                f"{type(r).__name__}"
            )
    return found


class RouterReplay:
    """The generator's routes, set per forward pass, applied by every MoE layer's router of the
    models attached."""

    def __init__(self) -> None:
        self._routes: torch.Tensor | None = None  # [tokens, layers, top_k]
        self._known: torch.Tensor | None = None  # [tokens] bool

    def attach(self, model: torch.nn.Module) -> None:
        """Replay the routes set here in ``model``'s routers too."""
        for layer, router in enumerate(routers(model)):
            router.forward = self._replayed(router, layer, router.forward)

    def set(self, routes: torch.Tensor | None, known: torch.Tensor | None) -> None:
        """The routes of the next forward pass (and of its recomputation); None: the model's own."""
        self._routes, self._known = routes, known

    def _replayed(self, router: torch.nn.Module, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        renormalise = bool(getattr(router, "norm_topk_prob", True))

        @functools.wraps(forward)
        def replayed(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits, scores, chosen = forward(hidden_states)
            routes, known = self._routes, self._known
            if routes is None or known is None:
                return logits, scores, chosen
            experts = replayed_experts(routes, known, layer, chosen)
            weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, experts)
            if renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), experts

        return replayed


class RouteRecorder:
    """Keeps the expert ids each MoE router chose in the forward passes that ran since `clear`
    ([tokens, layers, top_k] per pass): to compare a trainer's routing with a generator's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.passes: list[list[torch.Tensor]] = []
        self._current: list[torch.Tensor] = []
        found = routers(model)
        for layer, router in enumerate(found):
            router.register_forward_hook(functools.partial(self._hook, layer, len(found)))

    def _hook(self, layer: int, layers: int, _module: Any, _args: Any, out: Any) -> None:
        self._current.append(out[-1].detach())
        if layer == layers - 1:
            self.passes.append(self._current)
            self._current = []

    def routes(self) -> list[torch.Tensor]:
        """Each pass's [tokens, layers, top_k] expert ids."""
        return [torch.stack(p, dim=1) for p in self.passes]

    def clear(self) -> None:
        self.passes, self._current = [], []

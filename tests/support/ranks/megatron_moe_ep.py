"""A tiny Qwen3-MoE in megatron-core on CPU, at any expert-parallel size (tests/unit/test_megatron_moe.py).

    torchrun --standalone --nproc-per-node N tests/support/ranks/megatron_moe_ep.py IDS OUT MODEL [MODEL ...]

Every rank joins a gloo group with expert parallelism N (the dense parts data-parallel over the
same N ranks), and for each MODEL (an HF folder) builds the megatron model, loads the weights of
its own experts through `services.trainer.backends.megatron_moe`, runs a forward and backward pass
on the token ids saved in IDS (a [B, T] tensor, the same batch on every rank) and writes
OUT/<model folder name>-rank<R>.pt: the logits, and its part of the MLP weights and of their
gradients converted back to HF naming (global expert ids). The pytest process imports the same
helpers to run the one-rank reference.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from services.trainer.backends import megatron_cpu  # noqa: E402
from services.trainer.backends.megatron_convert import hf_to_megatron, megatron_to_hf  # noqa: E402
from services.trainer.backends.megatron_moe import mlp_megatron_to_hf  # noqa: E402
from services.trainer.backends.megatron_setup import build_gpt_model  # noqa: E402


def init_parallel(expert_parallel: int, seed: int = 0) -> None:
    """Megatron's groups with ``expert_parallel`` EP ranks on an existing process group, on CPU."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=expert_parallel)
    megatron_cpu.apply(moe=True, pipeline=False)
    megatron_cpu.seed_rng(seed)


def build_megatron(hf: dict[str, Any], expert_parallel: int) -> torch.nn.Module:
    """The backend's megatron GPTModel of ``hf`` (random weights), with parallel (vocabulary-split)
    logits gathered whole as the backend gathers them."""
    return build_gpt_model(hf, torch.float32, cpu_init=True, expert_parallel=expert_parallel)


def _layers(hf: dict[str, Any]) -> range:
    return range(hf["num_hidden_layers"])


def to_megatron(state: dict[str, torch.Tensor], hf: dict[str, Any], ep_rank: int, ep_size: int) -> dict[str, Any]:
    """The HF state in megatron naming, this EP rank's experts only."""
    return hf_to_megatron(state, hf, ep_rank=ep_rank, ep_size=ep_size)


def mlp_to_hf(state: dict[str, torch.Tensor], hf: dict[str, Any], ep_rank: int, ep_size: int) -> dict[str, Any]:
    """Every layer's MLP (this EP rank's experts) of a megatron state in HF naming."""
    out: dict[str, torch.Tensor] = {}
    for i in _layers(hf):
        out.update(mlp_megatron_to_hf(state, hf, i, ep_rank=ep_rank, ep_size=ep_size))
    return out


def to_hf(state: dict[str, torch.Tensor], hf: dict[str, Any], ep_rank: int, ep_size: int) -> dict[str, Any]:
    """The inverse of `to_megatron`."""
    return megatron_to_hf(
        {k: v for k, v in state.items() if not k.endswith("_extra_state")}, hf, ep_rank=ep_rank, ep_size=ep_size
    )


def load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``model``; every parameter must be in it and nothing else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, f"missing {missing[:5]}, unexpected {unexpected[:5]}"


def forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of ``ids`` (causal) and the gradients of their next-token loss, by parameter name."""
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = megatron_cpu.causal_mask(ids.shape[1], ids.device)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=mask)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _rank_main(ids_path: Path, out: Path, models: list[Path]) -> None:
    import json

    from megatron.core import parallel_state

    from services.trainer.backends.megatron_convert import read_hf_state

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        init_parallel(world)
        ids = torch.load(ids_path)
        for folder in models:
            hf = json.loads((folder / "config.json").read_text())
            model = build_megatron(hf, world)
            load(model, to_megatron(read_hf_state(folder), hf, rank, world))
            logits, grads = forward_backward(model, ids)
            weights = mlp_to_hf(model.state_dict(), hf, rank, world)
            result = {"logits": logits, "weights": weights, "grads": mlp_to_hf(grads, hf, rank, world)}
            torch.save(result, out / f"{folder.name}-rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])

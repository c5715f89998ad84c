"""The transformers model adapter (``trainer.backend: torch``): a Hugging Face causal LM in plain
torch, on one rank or sharded over many with FSDP2.

The policy loads with ``AutoModelForCausalLM.from_pretrained`` (the same code loads the tiny demo
model and a real checkpoint) with float32 master weights. ``policy.precision: bfloat16`` computes
in bfloat16 (autocast on one rank, FSDP2's mixed-precision policy on many) while gradients are
reduced, and the optimizer steps, in float32. Many ranks (`services.trainer.ranks`): each decoder
layer, then the root, is ``fully_shard``-ed over a one-dimensional mesh of every rank
(`services.trainer.sharding`; ``policy.dtensor_cfg``: activation checkpointing, CPU offload), and
every rank is a data rank (`layout.data_parallel`); at many ranks each rank reads only its shards
of the checkpoint when the files allow it (`services.trainer.sharded_load`; ``read_own_shards``
False reads it whole on every rank, which the trainer benchmark compares against).

Checkpoints are torch's Distributed Checkpoint state dicts of model and optimizer (any world size
reads them back). Published weights are gathered one tensor at a time, each rank writing its
share of the files (`services.trainer.weight_export`), with the model's config beside them; the
collective refit streams the same tensors. Every tensor goes under the name the starting
checkpoint stores it by, and the checkpoint's tensors the model does not hold (MTP weights, a
multimodal checkpoint's vision tower) are carried unchanged (`hf_format`): a multimodal Qwen3.5
checkpoint (``Qwen3_5MoeForConditionalGeneration``) trains as its language model
(``Qwen3_5MoeForCausalLM``, which ``AutoModelForCausalLM`` builds from its ``text_config``) and
is published as the multimodal checkpoint again, its config included. Built by
`services.trainer.backends.build_backend`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.trainer.backends import step
from services.trainer.backends.adapter import LoadedModel, OnLogits
from services.trainer.backends.hf_format import published_config, read_tensors, untrained
from services.trainer.backends.layout import Layout, data_parallel
from services.trainer.backends.linear_attention import rows_apart, separate_rows
from services.trainer.backends.micro_batch import MicroBatch, sampled_logprobs_of
from services.trainer.backends.routing_replay import RouterReplay
from services.trainer.ranks import Ranks
from services.trainer.sharded_load import checkpoint_files, load_sharded, shard_readable
from services.trainer.sharding import shard_model
from services.trainer.weight_export import ShardWriter, gathered, rank_tensors, refit_threads
from shared.run_config import RunConfig
from shared.sections.policy import PolicySection
from shared_torch.stored_names import as_stored, stored_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_pretrained(path: str, dtype: torch.dtype) -> PreTrainedModel:
    """A Hugging Face causal LM from ``path`` (a folder, or a hub id where reachable) in ``dtype``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def compute_dtype(policy: PolicySection) -> torch.dtype:
    """The precision the policy computes and is published in (``policy.precision``)."""
    return torch.float32 if policy.precision == "float32" else torch.bfloat16


def adamw_settings(policy: PolicySection) -> dict[str, Any]:
    """torch AdamW's arguments from ``policy.optimizer``."""
    opt = policy.optimizer
    return {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}


class HFAdapter:
    name = "torch"

    def __init__(self, policy: PolicySection, layout: Layout, *, read_own_shards: bool = True) -> None:
        self.policy = policy
        self.layout = layout
        self.dtype = compute_dtype(policy)
        self.read_own_shards = read_own_shards
        # policy.moe_routing_replay: the routes of the next forward pass, in every model built
        self.replay = RouterReplay() if policy.moe_routing_replay else None

    @classmethod
    def from_config(cls, cfg: RunConfig, ranks: Ranks, *, read_own_shards: bool = True) -> HFAdapter:
        return cls(cfg.policy, data_parallel(ranks), read_own_shards=read_own_shards)

    @property
    def _ranks(self) -> Ranks:
        return self.layout.world

    def build(self) -> LoadedModel:
        """The policy on this rank's device (float32 master weights), sharded over the ranks when
        there are several; its linear-attention layers keep a pack's rows apart, its routers replay
        the generator's routes (``policy.moe_routing_replay``)."""
        loaded = self._load()
        separate_rows(loaded.module)
        if self.replay is not None:
            self.replay.attach(loaded.module)
        return loaded

    def _load(self) -> LoadedModel:
        path, dtensor, ranks = self.policy.model_name, self.policy.dtensor_cfg, self._ranks
        files = shard_readable(path) if ranks.sharded and self.read_own_shards else None
        if files is not None:
            model, read = load_sharded(
                path,
                files,
                ranks,
                self.dtype,
                activation_checkpointing=dtensor.activation_checkpointing,
                cpu_offload=dtensor.cpu_offload,
            )
            return LoadedModel(model, read)
        model = load_pretrained(path, torch.float32)
        if dtensor.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not ranks.sharded:
            return LoadedModel(model.to(ranks.device))
        return LoadedModel(shard_model(model.to(ranks.device), ranks, self.dtype, cpu_offload=dtensor.cpu_offload))

    def pad_token_id(self, model: torch.nn.Module) -> int:
        return int(model.config.pad_token_id or 0)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW over every parameter with the schedule's settings (``policy.optimizer``)."""
        return torch.optim.AdamW(model.parameters(), **adamw_settings(self.policy))

    # ---- the step's passes ----------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bfloat16 compute over float32 weights on one rank (FSDP2 casts on its own)."""
        if self.dtype == torch.float32 or self._ranks.sharded:
            return contextlib.nullcontext()
        autocast: contextlib.AbstractContextManager[Any] = torch.autocast(self._ranks.device.type, dtype=self.dtype)
        return autocast

    def logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """[B, T, V] logits. A pack runs as one sequence with its position ids and no attention
        mask (transformers then keeps each row to itself in attention layers; linear-attention
        layers run row by row: `services.trainer.backends.linear_attention`)."""
        if self.replay is not None:
            self.replay.set(mb.routes, mb.routes_known)
        with self._autocast():
            if mb.pack is not None:
                pack = mb.pack
                with rows_apart(pack.starts, pack.input_ids.shape[1]):
                    return model(input_ids=pack.input_ids, position_ids=pack.position_ids, use_cache=False).logits
            return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits

    def logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, untruncated: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        gen = self.policy.generation
        return sampled_logprobs_of(logits, mb, gen.temperature, gen.top_p, untruncated)

    def run(self, model: torch.nn.Module, mbs: list[MicroBatch], on_logits: OnLogits, *, forward_only: bool) -> None:
        step.in_order(model, mbs, self.logits, self.backward, on_logits, forward_only=forward_only)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grads(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def grads_ready(self, model: torch.nn.Module) -> None:
        """Nothing to do: FSDP2 reduced the gradients in the backward passes."""

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        """torch's clipping by the global norm (a DTensor's over its mesh), in its two halves so that
        a non-finite norm leaves the gradients as they are (not all NaN), for the step runner to
        name the parameters that hold one."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        value = _as_float(norm)
        if math.isfinite(value):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return value

    # ---- state and weights ----------------------------------------------------------------------

    def checkpoint_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool = False
    ) -> dict[str, Any]:
        """torch's state dicts of model and optimizer (sharded ones at many ranks); an
        asynchronous save stages its own copy, so ``copy`` changes nothing here."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def restore_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def save_weights(self, model: torch.nn.Module, out_dir: Path, max_file_bytes: int) -> dict[str, str]:
        """Publish the policy in the compute precision, gathered one tensor at a time; every rank
        writes its share of the files. The files' digests: this rank's, and on rank 0 every rank's."""
        writer = ShardWriter(out_dir, max_file_bytes, ranks=self._ranks)
        with refit_threads():
            for name, tensor in as_stored(model, rank_tensors(model, self.dtype, self._ranks, skip=_tied_keys(model))):
                writer.add(name, tensor)
            if self._ranks.is_root:
                for name, tensor in self._untrained(model):
                    writer.add(name, tensor)
            writer.close()
        if self._ranks.is_root:
            published_config(model, self.policy.model_name).save_pretrained(out_dir)
            gen_config = getattr(model, "generation_config", None)
            if gen_config is not None:
                gen_config.save_pretrained(out_dir)
        return writer.manifest

    def _untrained(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The starting checkpoint's tensors the model does not hold (MTP weights, a multimodal
        checkpoint's vision tower), as stored there."""
        files = checkpoint_files(self.policy.model_name)
        if files is None:
            return iter(())
        return read_tensors(files, untrained(model, files))

    def weight_metadata(self, model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        """Under the checkpoint's names, from the state dict's shapes alone (no gather)."""
        return stored_names(model, _tied_keys(model))

    def weight_shards(self, model: torch.nn.Module) -> Any:
        """Each rank's FSDP2 rows (the whole model at one rank), read as the published tensors."""
        from services.trainer.reshard_source import FsdpShards

        world = self.layout.world
        return FsdpShards(model, world.world_size, world.rank, _tied_keys(model))

    def weight_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Where and as they are (float32: the sender casts them as it packs them), under the
        checkpoint's names; every rank gets each tensor. The untrained ones stay where they are."""
        return as_stored(model, gathered(model, _tied_keys(model)))


def _tied_keys(model: torch.nn.Module) -> frozenset[str]:
    tied = getattr(model.config, "tie_word_embeddings", False)
    return frozenset({"lm_head.weight"}) if tied else frozenset()


def _as_float(norm: torch.Tensor) -> float:
    """A gradient norm as a float (a DTensor's is gathered first)."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

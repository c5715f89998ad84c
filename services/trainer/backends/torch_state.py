"""The torch backend's weights and state: the policy published for the generators (gathered one
tensor at a time, each rank writing its share of the files) and the learner's checkpoints (a
Distributed Checkpoint of model and optimizer, any world size; the schedule and RNG from rank 0).
Mixed into `services.trainer.backends.torch_backend.TorchBackend`, which owns the attributes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from services.trainer.ranks import Ranks
from services.trainer.weight_export import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    gathered,
    rank_tensors,
    refit_threads,
)


class TorchState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    ranks: Ranks
    dtype: torch.dtype
    async_save: bool
    updates: int
    _pending_save: Future[Any] | Any | None

    # Tests lower it to spread a tiny model over many files.
    max_weight_file_bytes: int = DEFAULT_MAX_SHARD_BYTES

    def save_weights(self, out_dir: Path) -> dict[str, str]:
        """Publish the policy in the compute precision, gathered one tensor at a time; every rank
        calls it and writes its share of the files (`services.trainer.weight_export`). The files'
        digests (file name -> digest): this rank's, and on rank 0 every rank's."""
        writer = ShardWriter(out_dir, self.max_weight_file_bytes, ranks=self.ranks)
        with refit_threads():
            for name, tensor in rank_tensors(self.model, self.dtype, self.ranks, skip=self._tied_keys()):
                writer.add(name, tensor)
            writer.close()
        if self.ranks.is_root:
            self.model.config.save_pretrained(out_dir)
            gen_config = getattr(self.model, "generation_config", None)
            if gen_config is not None:
                gen_config.save_pretrained(out_dir)
        return writer.manifest

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor `weight_tensors` gives (name, global shape), in its order, from the state
        dict's shapes alone (no gather)."""
        skip = self._tied_keys()
        return [(n, tuple(t.shape)) for n, t in self.model.state_dict().items() if n not in skip]

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """For a collective refit: the policy's tensors whole, one at a time, where and as they
        are (float32: the sender casts them as it packs them). Collective when sharded: every rank
        must drain it, and every rank gets each tensor."""
        return gathered(self.model, self._tied_keys())

    def _tied_keys(self) -> frozenset[str]:
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return frozenset({"lm_head.weight"}) if tied else frozenset()

    def save_checkpoint(self, path: Path) -> None:
        """Model and optimizer as a Distributed Checkpoint (every rank writes its shard; any world
        size reads it back), the schedule and RNG from rank 0. With ``async_save`` this returns
        once the shards are staged in memory; `wait_for_save` returns once they are on disk."""
        import torch.distributed.checkpoint as dcp

        self.wait_for_save()
        state = self._state_to_save()
        if self.ranks.is_root:
            torch.save(self._trainer_state(), path / "trainer_state.pt")
        where = str(path / "shards")
        if self.async_save:
            group = self.ranks.checkpoint_group
            self._pending_save = dcp.async_save(state, checkpoint_id=where, process_group=group, no_dist=group is None)
        else:
            dcp.save(state, checkpoint_id=where, no_dist=not self.ranks.sharded)

    def wait_for_save(self) -> None:
        """Block until the last asynchronous checkpoint write is on disk (raises its error)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            getattr(pending, "upload_completion", pending).result()

    def load_checkpoint(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(path / "shards"), no_dist=not self.ranks.sharded)
        self._restore_state(state)
        extra = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        self._resume_schedule(int(extra["scheduler"]["last_epoch"]))
        self.updates = int(extra["updates"])
        torch.set_rng_state(extra["torch_rng"])

    def _resume_schedule(self, updates_done: int) -> None:
        """The learning-rate schedule at ``updates_done``, computed from this run's groups (their
        number may differ from the saved run's: a sharded optimizer chains two)."""
        sched = self.scheduler
        sched.last_epoch = updates_done
        lrs = [base * fn(updates_done) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        sched._last_lr = lrs

    def _state_to_save(self) -> dict[str, Any]:
        """What `save_checkpoint` writes (`_dcp_state`; a backend whose state views its live
        tensors copies them for an asynchronous write)."""
        return self._dcp_state()

    def _restore_state(self, state: dict[str, Any]) -> None:
        """Put a loaded `_dcp_state` into the model and optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self._checkpointed_module(),
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self._checkpointed_module(), self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def _checkpointed_module(self) -> torch.nn.Module:
        """The module whose parameter names the checkpoint keeps (a wrapper's inner module)."""
        return self.model

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "updates": self.updates,
            "torch_rng": torch.get_rng_state(),
        }

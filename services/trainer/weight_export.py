"""Publishing the policy from sharded parameters, one tensor at a time.

A learner's parameters may be sharded over many ranks (FSDP2 DTensors). `full_tensors` walks the
model's state dict in one fixed order and gathers each tensor whole (a collective every rank
joins), so no rank ever holds more than one tensor beyond its own shard. Rank 0 feeds them to a
`ShardWriter`, which writes safetensors files of at most ``max_shard_bytes`` as it goes (and the
Hugging Face index naming them), so the writer holds at most one file's worth. The folder is what
generators load (`shared.weights_format`).

This stream of (name, tensor) pairs is the learner's weight-export interface: a transport that
moves tensors instead of files consumes the same iterator.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

DEFAULT_MAX_SHARD_BYTES = 2 << 30


def full_tensors(
    model: torch.nn.Module, dtype: torch.dtype, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state-dict tensor of ``model`` (but ``skip``), whole, as ``dtype``, on the CPU.
    Collective when the model is sharded: every rank must drain the iterator."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if name in skip:
            continue
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        yield name, whole.detach().to(dtype=dtype, device="cpu").contiguous()


class ShardWriter:
    """Writes tensors into ``model-0000k.safetensors`` files as they come, then names them as
    Hugging Face does (``model.safetensors`` alone, or ``model-0000k-of-0000n`` with an index)."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def close(self) -> list[Path]:
        """Write what is left and give the files their final names; the files, in order."""
        self._flush()
        n = len(self._files)
        if n == 0:
            raise ValueError("no tensor was written")
        final: list[Path] = []
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self._files, start=1):
            name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / name)
            final.append(self.out_dir / name)
            weight_map.update(dict.fromkeys(names, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return final

    def _flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        path = self.out_dir / f".part-{len(self._files) + 1:05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._files.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

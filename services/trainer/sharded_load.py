"""A Hugging Face checkpoint read straight into the trainer's FSDP2 shards: no rank holds the model.

Loading the whole checkpoint on every rank and then sharding it needs the full model in each
rank's memory first (and every rank reading every byte): at the reference run's size, 740 GiB of
bf16 per rank before anything is sharded. Here::

    config.json --> the model built with its parameters on the meta device (no memory; buffers
                    such as the rotary tables are built for real, as the model computes them)
                --> fully_shard, layer by layer (`services.trainer.sharding.shard_model`)
                --> to_empty: this rank's shards allocated on its device, uninitialised
                --> each parameter's own rows read from the safetensors files (``get_slice``
                    reads only that range), cast to float32 into the shard

so a rank reads and holds 1/world of the parameters. The range of each shard is torch's own
(``compute_local_shape_and_global_offset`` of the parameter's mesh and placements), so whatever
the mesh, the rows are the ones FSDP2 assigned. Used by the torch backend for a sharded policy
whose ``policy.model_name`` is a local folder of safetensors files (one file or an index) and
whose embeddings are not tied; anything else is loaded whole and then sharded, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.trainer.ranks import Ranks
from services.trainer.sharding import shard_model

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: str) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, for a local checkpoint folder; None when
    ``path`` is not one (a hub id, or weights in another format)."""
    folder = Path(path)
    if (folder / INDEX).is_file():
        weight_map: dict[str, str] = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE_FILE), framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE_FILE)
    return None


def shard_readable(path: str) -> dict[str, Path] | None:
    """The checkpoint's files (`checkpoint_files`) when `load_sharded` can read ``path`` shard by
    shard: a local safetensors folder of a model whose embeddings are not tied (a tied output
    layer shares its parameter, which is sharded once); else None."""
    from transformers import AutoConfig

    files = checkpoint_files(path)
    if files is None or getattr(AutoConfig.from_pretrained(path).get_text_config(), "tie_word_embeddings", False):
        return None
    return files


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile is put on the meta device; buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_sharded(
    path: str,
    files: dict[str, Path],
    ranks: Ranks,
    dtype: torch.dtype,
    *,
    activation_checkpointing: bool,
    cpu_offload: bool,
) -> tuple[torch.nn.Module, int]:
    """The policy at ``path`` as a sharded module on ``ranks.device`` with float32 master weights
    (``dtype`` compute), each rank having read only its own shards from ``files`` (`shard_readable`);
    and the bytes this rank read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = shard_model(model, ranks, dtype, cpu_offload=cpu_offload)
    offloaded = cpu_offload and ranks.device.type != "cpu"
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # to_empty would drop them too
    model.to_empty(device=torch.device("cpu") if offloaded else ranks.device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    read = _read_shards(model, files)
    log.info("rank %d read its shards of %s: %.1f MiB", ranks.rank, path, read / 2**20)
    return model, read


def _read_shards(model: torch.nn.Module, files: dict[str, Path]) -> int:
    """Fill every parameter's local shard from ``files``; the bytes read."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    missing = [name for name, _ in model.named_parameters() if name not in files]
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameters, e.g. {missing[:3]}")
    read = 0
    handles: dict[Path, Any] = {}
    with contextlib.ExitStack() as stack:
        for name, param in model.named_parameters():
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            stored = handles[file].get_slice(name)
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            else:
                local, shape, offset = param, tuple(param.shape), (0,) * param.dim()
            if tuple(stored.get_shape()) != tuple(param.shape):
                raise ValueError(f"{name}: the checkpoint holds {stored.get_shape()}, the model {tuple(param.shape)}")
            if local.numel() == 0:
                continue  # a rank past the end of a small tensor holds nothing of it
            rows = stored[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
            with torch.no_grad():
                local.copy_(rows.reshape(local.shape))
            read += rows.numel() * rows.element_size()
    return read

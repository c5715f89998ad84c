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

so a rank reads and holds 1/world of the parameters. Routed experts that transformers fuses in
memory (``mlp.experts.gate_up_proj`` [E, 2F, H], ``mlp.experts.down_proj`` [E, H, F]) while the
checkpoint stores them one by one (``mlp.experts.{e}.gate_proj.weight``, ...) are put together
from the experts of this rank's shard only (`FusedExperts`). The range of each shard is torch's own
(``compute_local_shape_and_global_offset`` of the parameter's mesh and placements), so whatever
the mesh, the rows are the ones FSDP2 assigned. Each parameter is read under the name the
checkpoint stores it by (`shared_torch.stored_names.follow_checkpoint` records on the model what
``from_pretrained`` would have: a multimodal checkpoint stores its language model under
``model.language_model.``), so the shards and every published version carry the checkpoint's
names. Used by the torch backend for a sharded policy
whose ``policy.model_name`` is a local folder of safetensors files (one file or an index) and
whose embeddings are not tied; anything else is loaded whole and then sharded, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
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

    from shared_torch.stored_names import follow_checkpoint

    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    follow_checkpoint(model, files)
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


_FUSED_EXPERTS = re.compile(r"^(?P<experts>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class FusedExperts:
    """A fused expert parameter stored expert by expert: for each expert, the tensors whose
    concatenation along their first dimension is its slice of the fused parameter."""

    parts: list[list[str]]

    @classmethod
    def of(cls, name: str, files: dict[str, Path]) -> FusedExperts | None:
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            return None
        kinds = ("gate_proj", "up_proj") if match["kind"] == "gate_up_proj" else ("down_proj",)
        parts: list[list[str]] = []
        while all(f"{match['experts']}.{len(parts)}.{k}.weight" in files for k in kinds):
            parts.append([f"{match['experts']}.{len(parts)}.{k}.weight" for k in kinds])
        return cls(parts) if parts else None


class _Reader:
    """Slices of the checkpoint's tensors, each file opened once; counts the bytes read."""

    def __init__(self, files: dict[str, Path], stack: contextlib.ExitStack) -> None:
        self.files, self._stack, self.read = files, stack, 0
        self._handles: dict[Path, Any] = {}

    def _slice(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
        return self._handles[file].get_slice(name)

    def shape(self, name: str, fused: FusedExperts | None) -> tuple[int, ...]:
        if fused is None:
            return tuple(self._slice(name).get_shape())
        first = [tuple(self._slice(p).get_shape()) for p in fused.parts[0]]
        return (len(fused.parts), sum(s[0] for s in first), *first[0][1:])

    def rows(self, name: str, fused: FusedExperts | None, box: tuple[slice, ...]) -> torch.Tensor:
        if fused is None:
            rows: torch.Tensor = self._slice(name)[box]
        else:  # whole experts of this shard, then the box's other dimensions
            experts = [torch.cat([self._slice(p)[:] for p in parts]) for parts in fused.parts[box[0]]]
            rows = torch.stack(experts)[(slice(None), *box[1:])]
        self.read += rows.numel() * rows.element_size()
        return rows


_STORED_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.\d+\.[^.]+\.weight$")


def checkpoint_name(model: torch.nn.Module, name: str, files: dict[str, Path]) -> str:
    """Parameter ``name`` as the checkpoint ``files`` names it: its stored name, or for fused
    experts stored one by one, the fused parameter's name under the stored experts' module
    (what `FusedExperts` reads)."""
    from shared_torch.stored_names import as_stored

    param = model.get_parameter(name)
    meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
    stored = [n for n, _ in as_stored(model, [(name, meta)])]
    if len(stored) == 1 and stored[0] in files:
        return stored[0]
    match = _STORED_EXPERT.match(stored[0])
    return f"{match['experts']}.{name.rsplit('.', 1)[1]}" if match else name


def _read_shards(model: torch.nn.Module, files: dict[str, Path]) -> int:
    """Fill every parameter's local shard from ``files``; the bytes read."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    stored = {name: checkpoint_name(model, name, files) for name, _ in model.named_parameters()}
    fused = {name: FusedExperts.of(s, files) for name, s in stored.items() if s not in files}
    missing = [name for name, f in fused.items() if f is None]
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameters, e.g. {missing[:3]}")
    with contextlib.ExitStack() as stack:
        reader = _Reader(files, stack)
        for name, param in model.named_parameters():
            layout = fused.get(name)
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            else:
                local, shape, offset = param, tuple(param.shape), (0,) * param.dim()
            held = reader.shape(stored[name], layout)
            if held != tuple(param.shape):
                raise ValueError(f"{name}: the checkpoint holds {list(held)}, the model {tuple(param.shape)}")
            if local.numel() == 0:
                continue  # a rank past the end of a small tensor holds nothing of it
            box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            rows = reader.rows(stored[name], layout, box)
            with torch.no_grad():
                local.copy_(rows.reshape(local.shape))
    return reader.read

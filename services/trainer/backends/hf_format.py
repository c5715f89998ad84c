"""The transformers model's tensors under the checkpoint's names, and the checkpoint's tensors the
model does not hold.

Published weights must be what a generator loads from a checkpoint of that model (vLLM's loaders
and ``from_pretrained`` read the stored names, fused experts one by one): `as_stored` and
`stored_names` (`shared_torch.stored_names`) turn each state-dict tensor back as it streams out.

Some stored tensors are never loaded at all: the multi-token-prediction (MTP) module of Qwen3-Next
and Qwen3.5 (``mtp.*``) is dropped by transformers' model and trained by nobody here, yet a
generator that drafts with it needs it; so is the vision tower of a multimodal checkpoint whose
language model the causal LM is (the released Qwen3.5's ``model.visual.*`` beside
``model.language_model.*``), which a generator serving images needs. `untrained` names them, and
the transformers adapter copies them, unchanged, from the run's starting checkpoint into every
published version (`services.trainer.backends.hf_adapter`; the megatron adapter likewise, with
`read_tensors`), so they survive every refit and checkpoint. `published_config` is the config
that goes beside them: the checkpoint's own (multimodal, ``text_config`` and ``vision_config``)
where the model is only its language model, so a published folder is the same kind of checkpoint
as the one the run started from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared_torch.stored_names import foreign

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


def untrained(model: torch.nn.Module, files: dict[str, Path]) -> list[str]:
    """The names in the checkpoint ``files`` (name -> file) under a module the model does not
    hold (``mtp.*`` beside ``model.*`` and ``lm_head.*``; ``model.visual.*`` beside
    ``model.language_model.*``)."""
    return foreign(model, files)


def published_config(model: PreTrainedModel, source: str) -> PreTrainedConfig:
    """The config to publish ``model`` with: the checkpoint ``source``'s own when ``model`` is only
    its language model (a causal LM built from a multimodal config's ``text_config``), else the
    model's."""
    from transformers import AutoConfig

    config: PreTrainedConfig = AutoConfig.from_pretrained(source)
    return config if config.get_text_config() is not config else model.config


def read_tensors(files: dict[str, Path], names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``names`` read from their files, as stored."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in in_file:
                yield name, f.get_tensor(name)


def carry_untrained(model: torch.nn.Module, source: Path, saved: Path) -> list[str]:
    """Add to the checkpoint ``model`` was just saved to (``saved``) the tensors of ``source``
    that the model does not hold, unchanged; their names. One file is rewritten with them; an
    indexed checkpoint gets one more file, named in its index."""
    import json

    from safetensors.torch import load_file, save_file

    from services.trainer.sharded_load import INDEX, SINGLE_FILE, checkpoint_files

    files = checkpoint_files(str(source))
    names = untrained(model, files) if files is not None else []
    if not names or files is None:
        return []
    extra = dict(read_tensors(files, names))
    if (saved / INDEX).is_file():
        save_file(extra, saved / "model-untrained.safetensors", metadata={"format": "pt"})
        index = json.loads((saved / INDEX).read_text())
        index["weight_map"].update(dict.fromkeys(names, "model-untrained.safetensors"))
        if "total_size" in index.get("metadata", {}):
            index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in extra.values())
        (saved / INDEX).write_text(json.dumps(index, indent=2))
    else:
        save_file({**load_file(saved / SINGLE_FILE), **extra}, saved / SINGLE_FILE, metadata={"format": "pt"})
    return names

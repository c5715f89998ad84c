"""A published weights folder checked against the checkpoint the run started from, for the
trainers' tests on the multimodal Qwen3.5-MoE (`tiny_multimodal_moe_dir`): the same kind of
checkpoint comes out as went in (its config, exactly its tensor names, the tensors no backend
trains unchanged), and transformers scores it as the backend does.

* `rows`: a few training rows of the tiny models' vocabulary.
* `transformers_logprobs`: each row's token logprobs under ``AutoModelForCausalLM`` on a folder,
  laid out as the backends give them ([rows, T], position 0 zero).
* `assert_published_as_started`: the published folder against the starting one.
* `assert_trains_and_publishes_as_started`: a backend built on the multimodal checkpoint scores
  as transformers does, trains a step, streams and publishes under the checkpoint's names, and
  transformers scores the published folder as the backend scores its trained policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from services.trainer.batch import Row, StepBatch

# the tensors of a multimodal Qwen3.5 checkpoint that no backend trains: the vision tower and the MTP module
UNTRAINED = ("model.visual.", "mtp.")


def rows(seed: int, n: int = 4, length: int = 12) -> StepBatch:
    """``n`` rows of ``length`` tokens, loss on the second half, groups of two."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(10, 800, size=length).astype(np.int64)
        tmask = np.zeros(length, np.float32)
        tmask[length // 2 :] = 1.0
        gen = (rng.normal(-3.0, 0.3, size=length) * tmask).astype(np.float32)
        out.append(Row(f"t{i}", f"g{i // 2}", ids, tmask, gen, reward=float(i % 2), advantage=1.0 - 2 * (i % 2)))
    return StepBatch(out)


def transformers_logprobs(folder, batch: StepBatch, temperature: float = 1.0) -> torch.Tensor:
    """[rows, T] token logprobs of ``batch``'s rows (all of one length) under the causal LM that
    ``AutoModelForCausalLM`` loads from ``folder``, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(np.stack([r.input_ids for r in batch.rows]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def assert_published_as_started(published, start) -> None:
    """``published`` is the checkpoint ``start`` again, trained: the same config (multimodal, its
    ``text_config`` and ``vision_config``), exactly its tensor names, the vision tower and MTP
    weights byte for byte, the language model moved; and the multimodal model transformers builds
    from it loads every tensor it has, none missing."""
    import transformers
    from safetensors.torch import load_file

    from shared.weights_format import safetensors_files

    def tensors(folder) -> dict[str, torch.Tensor]:
        return {k: v for f in safetensors_files(folder) for k, v in load_file(f).items()}

    def config(folder) -> dict:
        return json.loads((Path(folder) / "config.json").read_text())

    assert config(published) == config(start)
    ours, theirs = tensors(published), tensors(start)
    assert sorted(ours) == sorted(theirs)
    untrained = [k for k in theirs if k.startswith(UNTRAINED)]
    assert any(k.startswith("model.visual.") for k in untrained) and any(k.startswith("mtp.") for k in untrained)
    for k in untrained:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    assert any(not torch.equal(ours[k], theirs[k]) for k in theirs if k.startswith("model.language_model."))
    [architecture] = config(start)["architectures"]
    multimodal = getattr(transformers, architecture)
    _, info = multimodal.from_pretrained(published, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info


def assert_trains_and_publishes_as_started(backend, start: Path, out: Path, atol: float) -> None:
    """``backend`` (one rank, float32, built on the multimodal checkpoint ``start``): its logprobs
    are transformers' on ``start`` within ``atol``; a step trains; the collective refit's stream
    and the published folder (``out``) carry the checkpoint's names, the folder is ``start``
    trained (`assert_published_as_started`), and transformers scores it as the backend now does."""
    from safetensors import safe_open

    batch = rows(0)
    temperature = backend.policy.generation.temperature
    with torch.no_grad():
        torch.testing.assert_close(
            backend.logprobs(batch.rows), transformers_logprobs(start, batch, temperature), rtol=0, atol=atol
        )
    metrics = backend.train_step(batch)
    assert metrics.num_updates == 1 and np.isfinite([metrics.loss, metrics.grad_norm]).all() and metrics.grad_norm > 0
    with safe_open(str(start / "model.safetensors"), framework="pt") as f:
        trained = sorted(k for k in f.keys() if not k.startswith(UNTRAINED))
    assert any(k.startswith("model.language_model.") for k in trained)
    assert sorted(name for name, _ in backend.weight_metadata()) == trained
    assert sorted(name for name, _ in backend.weight_tensors()) == trained
    backend.save_weights(out)
    assert_published_as_started(out, start)
    with torch.no_grad():
        torch.testing.assert_close(
            backend.logprobs(batch.rows), transformers_logprobs(out, batch, temperature), rtol=0, atol=atol
        )

"""The tiny Qwen3.5-MoE's logprobs on the megatron backend at three 2-rank layouts in one launch
(tests/integration/test_megatron_ranks.py).

    torchrun --standalone --nproc-per-node 2 tests/support/ranks/megatron_hybrid_layouts.py MODEL OUT

For each layout the ranks take the logprobs of the same rows (`rows`) and the rank that holds them
writes OUT/<layout>.pt, {row key: [len] token logprobs}:

* ``pipeline2`` and ``expert2``: through the backend (`build_backend`, the rows packed into
  micro-batches of 64 tokens, `Backend.rows_logprobs`: megatron-core's pipeline schedule on two
  stages, or each rank holding half the experts); then each trains one step of
  `ranked_step.batch` (each rank its data rank's share, as `RankedLearner` deals them) and rank 0
  writes OUT/<layout>-step.json, the step's loss and gradient norm;
* ``tensor2``: the backend's megatron model split over two tensor-parallel ranks (built and loaded
  part by part as the adapter loads it, `megatron_tp.local_part`; each part gathers back to the
  whole tensor, `megatron_tp.gather_full`) in eval mode, its logits
  gathered, each row on its own, forward only and without sequence parallelism (the backend
  trains at tensor parallelism with it: tests/integration/test_megatron_ranks.py).

Between layouts megatron's groups are torn down and made again on the same process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from services.trainer.backends import build_backend, megatron_cpu, megatron_export, megatron_tp  # noqa: E402
from services.trainer.backends.megatron_convert import (  # noqa: E402
    SafetensorsState,
    hf_globals_to_megatron,
    hf_layer_to_megatron,
    padded_vocab,
)
from services.trainer.backends.megatron_setup import build_gpt_model  # noqa: E402
from services.trainer.batch import Row  # noqa: E402
from services.trainer.ranks import join, leaving  # noqa: E402
from shared.config import load  # noqa: E402
from shared.run_config import RunConfig  # noqa: E402
from tests.support.ranks.ranked_step import batch  # noqa: E402

LAYOUTS = {
    "pipeline2": ["policy.megatron_cfg.pipeline_model_parallel_size=2"],
    "expert2": ["policy.megatron_cfg.expert_model_parallel_size=2"],
}


def rows() -> list[Row]:
    """Six rows of lengths 9..40 (one past a 32-token chunk), ids below the tiny vocabulary."""
    rng = np.random.default_rng(7)
    out = []
    for i, n in enumerate((9, 40, 17, 23, 12, 30)):
        ids = rng.integers(10, 800, size=n).astype(np.int64)
        tmask = np.ones(n, np.float32)
        out.append(Row(f"r{i}", f"g{i // 2}", ids, tmask, np.zeros(n, np.float32), reward=0.0, advantage=0.0))
    return out


def config(model: Path, layout: list[str], backend: str = "megatron") -> RunConfig:
    """The run config of every layout (``backend``: the torch backend's, for a reference)."""
    return load(
        RunConfig,
        None,
        [
            f"policy.model_name={model}",
            "data.train_path=t.jsonl",
            f"trainer.backend={backend}",
            "trainer.torch_threads=1",
            "trainer.collective_timeout_s=60",
            "policy.train_micro_batch_size=2",
            "policy.sequence_packing.enabled=true",
            "policy.sequence_packing.train_mb_tokens=64",
            *layout,
        ],
        env={},
    )


def _tensor_parallel(model: Path) -> dict[str, torch.Tensor]:
    """Each row's logprobs from the model split over two tensor-parallel ranks (forward only)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
    megatron_cpu.apply(moe=True, pipeline=False)
    megatron_cpu.seed_rng(0)
    hf = json.loads((model / "config.json").read_text())
    gpt = build_gpt_model(hf, torch.float32, vocab_size=padded_vocab(hf))
    params = dict(gpt.named_parameters())
    state = SafetensorsState(model)
    parts = [hf_globals_to_megatron(state, hf)] + [hf_layer_to_megatron(state, hf, i) for i in range(4)]
    with torch.no_grad():
        for part in parts:
            for name, full in part.items():
                if name in megatron_export.VOCAB_ROWS:
                    full = F.pad(full, (0, 0, 0, padded_vocab(hf) - full.shape[0]))
                params[name].copy_(megatron_tp.local_part(full, params[name], name))
                # cut by name alone (a layout planned without a model) as the live parameter is
                rank = parallel_state.get_tensor_model_parallel_rank()
                assert torch.equal(megatron_tp.cut(full, name, hf, 2, rank), params[name]), name
                # the parts gather back to the whole tensor (as the export gathers them)
                assert torch.equal(megatron_tp.gather_full(params[name].detach(), params[name], name), full), name
    gpt.eval()
    out = {}
    for row in rows():
        ids = torch.from_numpy(row.input_ids)[None]
        positions = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            logits = gpt(
                input_ids=ids,
                position_ids=positions,
                attention_mask=megatron_cpu.causal_mask(ids.shape[1], ids.device),
                runtime_gather_output=True,
            )[0, :, : hf["vocab_size"]]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        out[row.key] = F.pad(lp, (1, 0))
    parallel_state.destroy_model_parallel()
    return out


def main(model: Path, out: Path) -> None:
    from megatron.core import parallel_state

    ranks = join(60.0)
    with leaving(ranks):
        for name, layout in LAYOUTS.items():
            backend = build_backend(config(model, layout), ranks)
            given = rows()
            found = backend.rows_logprobs(given, given[0])
            if backend.layout.last_stage and backend.layout.data.rank == 0 and backend.layout.stage.rank == 0:
                torch.save(found, out / f"{name}.pt")
            shares = backend.plan(batch(0))
            step = backend.train_share(shares[backend.layout.data.rank])
            if ranks.is_root:
                (out / f"{name}-step.json").write_text(json.dumps({"loss": step.loss, "grad_norm": step.grad_norm}))
            del backend
            parallel_state.destroy_model_parallel()
        found = _tensor_parallel(model)
        if ranks.is_root:
            torch.save(found, out / "tensor2.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

"""GPU check of the megatron backend (one GPU, under torchrun): logits of the megatron-core model
built from a Qwen3 (and a Qwen3-MoE, and a Qwen3.5-MoE: Gated DeltaNet through flash-linear-attention
where it is installed) checkpoint match transformers' within tolerance, three GRPO
updates run with the configured DDP (NaN check on), and the exported weights load back into
transformers unchanged.

    torchrun --nproc-per-node 1 scripts/gpu_check_megatron.py [MODEL_DIR]

MODEL_DIR defaults to the freshly built tiny dense model, a tiny Qwen3-MoE and the tiny Qwen3.5-MoE,
each checked.
Exits non-zero on any mismatch. scripts/gpu_check_megatron_ranks.sh checks the multi-GPU layouts.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.trainer.backends import build_backend  # noqa: E402
from services.trainer.backends.backend import Backend  # noqa: E402
from services.trainer.batch import Row, StepBatch  # noqa: E402
from shared.config import load  # noqa: E402
from shared.run_config import RunConfig  # noqa: E402


def main() -> int:
    assert torch.cuda.is_available(), "this check needs a GPU"
    tmp = Path(tempfile.mkdtemp(prefix="megatron-check-"))
    if len(sys.argv) > 1:
        models = [Path(sys.argv[1])]
    else:
        from streamrl.model_builder import build_tiny_model, build_tiny_moe, tiny_spec

        build_tiny_model(tmp / "tiny")
        build_tiny_moe(tmp / "tiny-moe", vocab_size=1024)
        build_tiny_model(tmp / "tiny-qwen3_5_moe", tiny_spec("qwen3_5_moe"))
        models = [tmp / "tiny", tmp / "tiny-moe", tmp / "tiny-qwen3_5_moe"]
    for model_dir in models:
        print(f"== {model_dir.name}")
        check(model_dir, tmp / f"export-{model_dir.name}")
    print("megatron backend GPU check passed")
    return 0


def check(model_dir: Path, out: Path) -> None:
    cfg = load(
        RunConfig,
        None,
        [
            f"policy.model_name={model_dir}",
            "data.train_path=unused.jsonl",
            "trainer.backend=megatron",
            "policy.generation.temperature=1.0",
            "run.seed=0",
        ],
        env={},
    )
    backend = build_backend(cfg)
    assert backend.model.ddp_config.check_for_nan_in_grad, "check_for_nan_in_grad must default to on"

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    ids = torch.randint(10, hf.config.vocab_size, (2, 48), device="cuda")
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)
        got = _megatron_logprobs(backend, ids)
    diff = (ref - got).abs().max().item()
    print(f"max |logprob(megatron) - logprob(transformers)| = {diff:.2e}")
    assert diff < 2e-3, diff

    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        n = int(rng.integers(16, 64))
        mask = np.zeros(n, np.float32)
        mask[n // 2 :] = 1
        rows.append(
            Row(
                f"t{i}",
                f"g{i // 4}",
                rng.integers(10, hf.config.vocab_size, n).astype(np.int64),
                mask,
                (rng.normal(-4, 0.3, n) * mask).astype(np.float32),
                reward=float(i % 2),
                advantage=float(rng.normal()),
            )
        )
    for step in range(3):
        m = backend.train_step(StepBatch(rows))
        print(f"step {step}: loss {m.loss:.4f} grad_norm {m.grad_norm:.4f}")
        assert np.isfinite(m.loss) and m.grad_norm > 0

    out.mkdir()
    backend.save_weights(out)
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        a = torch.log_softmax(back(input_ids=ids).logits.float(), -1)
        b = _megatron_logprobs(backend, ids)
    diff = (a - b).abs().max().item()
    print(f"exported weights in transformers vs megatron: {diff:.2e}")
    assert diff < 2e-3, diff


def _megatron_logprobs(backend: Backend, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax over the checkpoint's vocabulary of the megatron model's whole logits for ``ids``."""
    n = ids.shape[1]
    rows = [
        Row(f"r{i}", "g", row.cpu().numpy(), np.ones(n, np.float32), np.zeros(n, np.float32), reward=0.0)
        for i, row in enumerate(ids)
    ]
    logits = backend.adapter.logits(backend.model, backend.inputs(rows), whole=True)  # type: ignore[call-arg]
    return torch.log_softmax(logits[..., : backend.adapter.vocab].float(), -1)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())

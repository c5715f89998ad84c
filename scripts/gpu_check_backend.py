"""GPU check of a training backend on one GPU: for the tiny Qwen3, a tiny Qwen3-MoE and the tiny
Qwen3.5-MoE, the backend's token logprobs match transformers' (float32, same device) on average
within the precision's tolerance, three GRPO updates run (the megatron backend with its NaN check on), and the
exported weights load back into transformers and score as the backend does.

    python scripts/gpu_check_backend.py --backend torch --precision bfloat16 [MODEL_DIR ...]
    torchrun --nproc-per-node 1 scripts/gpu_check_backend.py --backend megatron [MODEL_DIR ...]

On CUDA the megatron backend's Gated DeltaNet layers run flash-linear-attention's kernels where it
is installed (the line ``gated delta kernels`` names which ran). Without models named, the three
tiny models are built in a temporary folder. Exits non-zero on any mismatch; prints one line per
model. ``STREAMRL_CHECK_ON_CPU=1`` runs the same check on the CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import os
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

# Mean |logprob(backend) - logprob(transformers in float32)| over every token: float32 differs only
# in the order of additions; bfloat16 compute (float32 master weights) rounds every matmul, and a
# router's rounding can send a token to another expert (on the CPU, the tiny Qwen3-MoE: 0.014 to 0.031
# on average).
TOLERANCE = {"float32": 2e-4, "bfloat16": 0.1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--backend", choices=("torch", "megatron"), required=True)
    ap.add_argument("--precision", choices=tuple(TOLERANCE), default="float32")
    args = ap.parse_args()
    on_cpu = os.environ.get("STREAMRL_CHECK_ON_CPU") == "1"
    assert on_cpu or torch.cuda.is_available(), "this check needs a GPU (STREAMRL_CHECK_ON_CPU=1 runs it on the CPU)"
    device = torch.device("cpu" if on_cpu else "cuda")
    tmp = Path(tempfile.mkdtemp(prefix=f"{args.backend}-check-"))
    models = args.models or _tiny_models(tmp)
    for model_dir in models:
        out = tmp / f"export-{model_dir.name}"
        diff, exported, losses = check(model_dir, out, args.backend, args.precision, device)
        print(
            f"{args.backend} {args.precision} {model_dir.name}: |logprob - transformers| mean {diff[0]:.1e} "
            f"max {diff[1]:.1e}; exported weights mean {exported[0]:.1e} max {exported[1]:.1e}; "
            f"losses {' '.join(f'{x:.4f}' for x in losses)}"
        )
    print(f"{args.backend} backend check passed on {device.type}")
    return 0


def _tiny_models(tmp: Path) -> list[Path]:
    from streamrl.model_builder import build_tiny_model, build_tiny_moe, tiny_spec

    build_tiny_model(tmp / "tiny")
    build_tiny_moe(tmp / "tiny-moe", vocab_size=1024)
    build_tiny_model(tmp / "tiny-qwen3_5_moe", tiny_spec("qwen3_5_moe"))
    return [tmp / "tiny", tmp / "tiny-moe", tmp / "tiny-qwen3_5_moe"]


def check(model_dir: Path, out: Path, backend_name: str, precision: str, device: torch.device):
    cfg = load(
        RunConfig,
        None,
        [
            f"policy.model_name={model_dir}",
            "data.train_path=unused.jsonl",
            f"trainer.backend={backend_name}",
            f"policy.precision={precision}",
            "policy.generation.temperature=1.0",
            "run.seed=0",
        ],
        env={},
    )
    backend = build_backend(cfg)
    if backend_name == "megatron":
        assert backend.model.ddp_config.check_for_nan_in_grad, "check_for_nan_in_grad must default to on"
        from megatron.core.ssm import gated_delta_net

        if gated_delta_net.chunk_gated_delta_rule is not None:  # bound for a model with Gated DeltaNet layers
            print(f"gated delta kernels: {gated_delta_net.chunk_gated_delta_rule.__module__}")
    assert next(backend.model.parameters()).device.type == device.type, "the policy is not on the check's device"

    from transformers import AutoModelForCausalLM

    vocab = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).config.vocab_size
    rng = np.random.default_rng(0)
    probe = [_row(f"p{i}", rng.integers(10, vocab, 48)) for i in range(2)]
    tolerance = TOLERANCE[precision]
    diff = _diff(_reference(model_dir, probe, device), backend, probe)
    assert diff[0] < tolerance, f"{model_dir.name}: logprobs differ from transformers' by {diff[0]:.2e} (> {tolerance})"

    rows = []
    for i in range(8):
        n = int(rng.integers(16, 64))
        mask = np.zeros(n, np.float32)
        mask[n // 2 :] = 1
        row = _row(f"t{i}", rng.integers(10, vocab, n), mask=mask, advantage=float(rng.normal()))
        row.gen_logprobs = (rng.normal(-4, 0.3, n) * mask).astype(np.float32)
        rows.append(row)
    losses = []
    for _ in range(3):
        m = backend.train_step(StepBatch(rows))
        assert np.isfinite(m.loss) and m.grad_norm > 0, m
        losses.append(m.loss)

    out.mkdir()
    backend.save_weights(out)
    exported = _diff(_reference(out, probe, device), backend, probe)
    assert exported[0] < tolerance, f"{model_dir.name}: exported weights score {exported[0]:.2e} apart (> {tolerance})"
    return diff, exported, losses


def _row(key: str, ids: np.ndarray, *, mask: np.ndarray | None = None, advantage: float = 0.0) -> Row:
    n = len(ids)
    mask = np.ones(n, np.float32) if mask is None else mask
    return Row(key, "g", ids.astype(np.int64), mask, np.zeros(n, np.float32), reward=0.0, advantage=advantage)


def _reference(model_dir: Path, rows: list[Row], device: torch.device) -> torch.Tensor:
    """transformers' float32 logprob of every token after the first, [rows, T - 1]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    ids = torch.tensor(np.stack([r.input_ids for r in rows]), device=device)
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _diff(reference: torch.Tensor, backend: Backend, rows: list[Row]) -> tuple[float, float]:
    """Mean and largest |difference| of the backend's logprobs from ``reference``."""
    with torch.no_grad():
        got = backend.logprobs(rows)[:, 1:].float()
    d = (reference.to(got.device) - got).abs()
    return d.mean().item(), d.max().item()


if __name__ == "__main__":
    sys.exit(main())

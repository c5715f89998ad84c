"""Compare two runs of tests/support/ranks/ranked_step.py (the GPU checks' verdict): each step's loss and gradient
norm within a relative tolerance, and the published weights within an absolute one.

    python scripts/compare_runs.py RUN_A RUN_B [--start MODEL_DIR] [--last-step-only] [--tol 1e-4]

With --start, the steps must also have moved the weights well beyond the tolerance (else the
comparison proves nothing); with --last-step-only, RUN_B's one step is RUN_A's last (a resumed run).
Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file


def weights(run: Path) -> dict:
    folder = run / "weights" if (run / "weights").is_dir() else run
    index = folder / "model.safetensors.index.json"
    names = ["model.safetensors"]
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out: dict = {}
    for name in names:
        out.update(load_file(folder / name))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--start", type=Path)
    p.add_argument("--last-step-only", action="store_true")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args()
    ma, mb = (json.loads((r / "metrics.json").read_text()) for r in (args.a, args.b))
    if args.last_step_only:
        ma = ma[-1:]
    assert len(ma) == len(mb), (len(ma), len(mb))
    for i, (x, y) in enumerate(zip(ma, mb, strict=True)):
        for key in ("loss", "grad_norm"):
            rel = abs(x[key] - y[key]) / max(abs(x[key]), 1e-8)
            print(f"step {i} {key}: {x[key]:.8f} vs {y[key]:.8f} (rel {rel:.1e})")
            assert rel < args.tol, f"{key} differs at step {i}"
    wa, wb = weights(args.a), weights(args.b)
    assert wa.keys() == wb.keys(), sorted(wa.keys() ^ wb.keys())[:5]
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    print(f"max |weights a - weights b| = {diff:.2e}")
    assert diff < args.tol, diff
    if args.start is not None:
        start = weights(args.start)
        moved = max(float((wa[k].float() - start[k].float()).abs().max()) for k in start)
        print(f"the steps moved the weights by up to {moved:.2e}")
        assert moved > 2 * args.tol, moved
    print("same")
    return 0


if __name__ == "__main__":
    sys.exit(main())

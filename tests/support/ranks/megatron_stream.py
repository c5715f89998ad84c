"""The megatron backend's collective-refit stream against its published files, at any layout.

    torchrun --nproc-per-node N tests/support/ranks/megatron_stream.py MODEL OUT [--set key=value ...]

Every rank builds the backend (as the trainer does), publishes the policy to OUT/weights
(`save_weights`) and drains `weight_tensors`; rank 0 writes OUT/stream.json: the metadata every
rank computed (equal on all of them), and for each streamed tensor its name, shape, dtype and
whether it equals the published file's tensor bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from services.trainer.backends import build_backend  # noqa: E402
from services.trainer.ranks import SINGLE, join, launched_world_size, leaving  # noqa: E402
from tests.support.ranks.ranked_step import config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(args.model, ["trainer.backend=megatron", *args.set])
    ranks = join(cfg.trainer.collective_timeout_s) if launched_world_size() > 1 else SINGLE
    with leaving(ranks):
        backend = build_backend(cfg, ranks, max_weight_file_bytes=512 * 1024)  # many files, written by every rank
        backend.save_weights(out / "weights")
        metadata = backend.weight_metadata()
        every_ranks = ranks.gather(metadata)
        streamed = list(backend.weight_tensors())
        if ranks.is_root:
            from safetensors.torch import load_file

            published: dict[str, torch.Tensor] = {}
            for f in sorted((out / "weights").glob("*.safetensors")):
                published.update(load_file(f))
            report = {
                "metadata": [[n, list(s)] for n, s in metadata],
                "same_on_every_rank": all(m == metadata for m in every_ranks),
                "published": sorted(published),
                "streamed": [
                    {
                        "name": n,
                        "shape": list(t.shape),
                        "dtype": str(t.dtype),
                        "equal": n in published and torch.equal(t, published[n]),
                    }
                    for n, t in streamed
                ],
            }
            (out / "stream.json").write_text(json.dumps(report))
        else:
            assert not streamed, "only rank 0 receives the stream"
    return 0


if __name__ == "__main__":
    sys.exit(main())

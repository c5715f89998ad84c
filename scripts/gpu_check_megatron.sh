#!/usr/bin/env bash
# GPU check of the megatron training backend: one GPU, torchrun, a few steps (see the .py file).
# Needs the `vllm` (or plain torch CUDA) environment plus `pip install -e ".[megatron]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check_megatron.py "$@"

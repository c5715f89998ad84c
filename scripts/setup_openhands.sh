#!/usr/bin/env bash
# Idempotent set-up of the OpenHands SDK for the gym gateway's `openhands` environment.
#
# The SDK needs Python >= 3.12 and its own dependency tree (LiteLLM, browser-use, ...), so it
# lives in its own virtualenv, .venv-openhands, and the driver runs it as a separate process.
# Also installs tmux (the SDK's terminal tool drives a shell through it) when it is missing.
# Re-running is fast: a stamp file records the pinned versions that were installed.
#
#   OPENHANDS_PYTHON=/path/to/python3.12 bash scripts/setup_openhands.sh   # choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=(openhands-sdk==1.58.2 openhands-tools==1.58.2)
VENV=.venv-openhands
stamp=$VENV/.streamrl-openhands-installed

find_python() {
  # A pyenv shim answers `command -v` even when its version is not selected, so each candidate
  # must actually run.
  local candidates=()
  [ -n "${OPENHANDS_PYTHON:-}" ] && candidates+=("$OPENHANDS_PYTHON")
  candidates+=(python3.12 python3.13)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12 "$(pyenv root)"/versions/3.13*/bin/python3.13)
  fi
  local py
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

if ! command -v tmux >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  # test.sh runs the set-up scripts side by side: apt waits for another one's lock
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq && $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq tmux
fi

want="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-16)"
if [ -x $VENV/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ ! -x $VENV/bin/python ]; then
  if ! PY=$(find_python); then
    echo "the OpenHands SDK needs Python >= 3.12: no python3.12 found (set OPENHANDS_PYTHON to one)" >&2
    exit 1
  fi
  "$PY" -m venv $VENV
fi
$VENV/bin/python -m pip install --disable-pip-version-check -q "${PINS[@]}"
LITELLM_LOCAL_MODEL_COST_MAP=True $VENV/bin/python -c \
  "import openhands.sdk, openhands.tools.terminal, openhands.tools.file_editor"
echo "$want" > "$stamp"

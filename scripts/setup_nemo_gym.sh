#!/usr/bin/env bash
# Idempotent set-up of the NeMo-Gym package for the gym gateway's `nemo_gym` environment.
#
# nemo-gym needs Python >= 3.13 and its own dependency tree (Ray, MLflow, Hydra, ...), so it lives
# in its own virtualenv, .venv-nemo-gym; scripts/nemo_gym_serve.py runs its servers from there.
# The version and every dependency are pinned (scripts/nemo_gym_pins.txt). Re-running is fast: a
# stamp file records the pins that were installed.
#
# Why --ignore-requires-python: every nemo-gym release from 0.5.0 on declares Python >= 3.13.14,
# and the one before, 0.4.0, lacks the per-rollout model routing (/ng-rollout/<id>/...) the driver
# relies on. CPython 3.13.0 (pyenv) runs the servers this project uses.
#
#   NEMO_GYM_PYTHON=/path/to/python3.13 bash scripts/setup_nemo_gym.sh   # choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE=nemo-gym==0.7.0
PINS=scripts/nemo_gym_pins.txt
VENV=.venv-nemo-gym
stamp=$VENV/.streamrl-nemo-gym-installed

find_python() {
  # A pyenv shim answers `command -v` even when its version is not selected, so each candidate
  # must actually run.
  local candidates=()
  [ -n "${NEMO_GYM_PYTHON:-}" ] && candidates+=("$NEMO_GYM_PYTHON")
  candidates+=(python3.13)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.13*/bin/python3.13)
  fi
  local py
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys, venv; sys.exit(sys.version_info < (3, 13))' >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

want="$( (echo "$PACKAGE"; cat "$PINS") | sha256sum | cut -c1-16)"
if [ -x $VENV/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ ! -x $VENV/bin/python ]; then
  if ! PY=$(find_python); then
    echo "nemo-gym needs Python >= 3.13: no python3.13 found (set NEMO_GYM_PYTHON to one)" >&2
    exit 1
  fi
  "$PY" -m venv $VENV
fi
$VENV/bin/python -m pip install --disable-pip-version-check -q --ignore-requires-python -c "$PINS" "$PACKAGE"
$VENV/bin/python -c "import nemo_gym.global_config, nemo_gym.server_utils"
echo "$want" > "$stamp"

#!/usr/bin/env bash
# The README's second command: set up, run the gates (ruff lint and format check, mypy), then the
# three test tiers (unit, integration, e2e). A failing gate stops it before pytest starts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/k8s_tools.sh  # kubectl (with kustomize) for the offline checks of deploy/k8s
bash scripts/setup_openhands.sh  # the OpenHands driver's tests run a real agent in its own virtualenv
bash scripts/setup_nemo_gym.sh  # the NeMo-Gym driver's tests run the nemo-gym package's servers in its own virtualenv

.venv/bin/ruff check services shared shared_torch streamrl tests scripts
.venv/bin/ruff format --check services shared shared_torch streamrl tests scripts
.venv/bin/mypy  # files and strictness from [tool.mypy] in pyproject.toml
exec .venv/bin/python -m pytest "$@"

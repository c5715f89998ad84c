#!/usr/bin/env bash
# The README's second command: set up, then run the three test tiers (unit, integration, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/k8s_tools.sh  # kubectl (with kustomize) for the offline checks of deploy/k8s
bash scripts/setup_openhands.sh  # the OpenHands driver's tests run a real agent in its own virtualenv
exec .venv/bin/python -m pytest "$@"

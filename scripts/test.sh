#!/usr/bin/env bash
# The README's second command: set up, then run the three test tiers (unit, integration, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# The README's first command: set up, then run the async GRPO demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamrl demo "$@"

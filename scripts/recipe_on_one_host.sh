#!/usr/bin/env bash
# The reference recipe (deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml) on one host: the same
# file under `streamrl up` with the overrides of qwen3_5_397b_a17b_on_one_host.overrides (each
# named there with its reason), on the demo's warm-started tiny Qwen3.5-MoE. Kept from the recipe:
# the trainer's layout shape (Megatron tensor x pipeline x expert, 2 x 2 x 2 on four ranks,
# sequence parallel), bfloat16, sequence packing at 65,536 tokens, a trajectory age of 1, the
# clipped and truncated importance-corrected loss and the sequence-error mask, the generator's
# settings (vLLM, expert parallel, bfloat16, prefix caching, dummy weights until the first refit,
# temperature 1.0) and the validation sampling.
#
#   scripts/recipe_on_one_host.sh [OUT] [streamrl up options or key=value ...]
#                                                       (OUT: runs/recipe-on-one-host)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/recipe-on-one-host}
shift || true
recipe=deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml
[ -x .venv/bin/streamrl ] || bash scripts/setup.sh
.venv/bin/streamrl demo --arch qwen3_5_moe --out "$out" --prepare-only
mapfile -t overrides < <(grep -v '^#' "${recipe%_64gpu.yaml}_on_one_host.overrides" | sed "s#\${OUT}#$out#g")
exec .venv/bin/streamrl up "$recipe" "${overrides[@]}" "$@"

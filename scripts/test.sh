#!/usr/bin/env bash
# The README's second command: set up, run the gates (ruff lint and format check, mypy), then the
# test tiers (unit, integration, e2e, faults, soak, compose, multihost, slurm). A failing gate or
# set-up stops it before pytest starts.
#
# The agent harnesses' virtualenvs, kubectl and Slurm are set up in the background while the gates
# run (they download; the gates compute). pytest runs the test files on STREAMRL_TEST_WORKERS
# processes (pytest-xdist, default 3; 0 runs them in this process), each file whole on one worker
# (its module fixtures start once), in collection order (pyproject.toml's testpaths), so the long
# compose, e2e, multihost and slurm files start first. Arguments pass through to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
bash scripts/k8s_tools.sh &  # kubectl (with kustomize) for the offline checks of deploy/k8s
pids+=($!)
bash scripts/setup_slurm.sh &  # Slurm and MUNGE (apt, as root) for the slurm tests (tests/slurm)
pids+=($!)
bash scripts/setup_openhands.sh &  # the OpenHands driver's tests run a real agent in its own virtualenv
pids+=($!)
bash scripts/setup_nemo_gym.sh &  # the NeMo-Gym driver's tests run the nemo-gym package's servers in its own virtualenv
pids+=($!)

.venv/bin/ruff check services shared shared_torch streamrl tests scripts
.venv/bin/ruff format --check services shared shared_torch streamrl tests scripts
.venv/bin/mypy  # files and strictness from [tool.mypy] in pyproject.toml
for pid in "${pids[@]}"; do
  wait "$pid"
done
trap - EXIT

workers=${STREAMRL_TEST_WORKERS:-3}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# More test processes than cores: torch's OpenMP threads would spin waiting for each other (the
# demo's warm start beside three busy processes took 231 s at two threads, 133 s at one). One
# intra-op thread per process unless set; vLLM binds its own, and torchrun's ranks take one anyway.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"

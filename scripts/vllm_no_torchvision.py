"""Let vLLM's Qwen3.5 models import where torchvision cannot (run by scripts/setup.sh).

vLLM registers ``Qwen3_5MoeForCausalLM`` in a module that imports its Qwen3-VL and Qwen2-VL
modules, and those import ``smart_resize`` from transformers' torchvision-backed Qwen2-VL image
processor, which imports torchvision at its top. No torchvision build matches the CPU build of
torch 2.13 on PyPI (PyPI's links CUDA libraries and fails with "operator torchvision::nms does
not exist"); the PyTorch CPU index has one (setup.sh installs it where that index is reachable).

Without it, transformers itself falls back to its PIL image processor, whose module defines the
same ``smart_resize``. This script points vLLM's two imports at that module, after checking that
the two definitions are the same function (the same syntax tree), and refuses otherwise. It
changes nothing when torchvision imports, and running it twice changes nothing more.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
VLLM_MODULES = ("vllm.model_executor.models.qwen2_vl", "vllm.model_executor.models.qwen3_vl")


def _path(module: str) -> Path:
    spec = importlib.util.find_spec(module.rsplit(".", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{module}: its package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / (module.rsplit(".", 1)[1] + ".py")


def _function(path: Path, name: str) -> str:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.dump(node)
    raise SystemExit(f"{path}: no function {name}")


def torchvision_imports() -> bool:
    return subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0


def main() -> int:
    if torchvision_imports():
        print("torchvision imports: vLLM's Qwen3.5 modules need no change")
        return 0
    if _function(_path(TORCHVISION_MODULE), "smart_resize") != _function(_path(PIL_MODULE), "smart_resize"):
        raise SystemExit(f"smart_resize differs between {TORCHVISION_MODULE} and {PIL_MODULE}: not changing vLLM")
    for module in VLLM_MODULES:
        path = _path(module)
        text = path.read_text()
        changed = text.replace(f"from {TORCHVISION_MODULE} import", f"from {PIL_MODULE} import")
        if changed != text:
            path.write_text(changed)
            print(f"{module}: smart_resize now comes from {PIL_MODULE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

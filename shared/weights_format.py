"""The on-disk format of a published weight version: a folder of ``*.safetensors`` files (plus
the model's config), identified by a sha256 over the safetensors bytes in sorted file-name order.

The trainer computes the checksum when it publishes a version; every generator recomputes it
before loading, so a torn or foreign folder is refused instead of served.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    return files


def checksum_dir(path: str | Path) -> str:
    """sha256 hex digest over the bytes of the folder's safetensors files, in name order."""
    h = hashlib.sha256()
    for f in safetensors_files(path):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def dir_num_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in safetensors_files(path))

"""The on-disk format of a published weight version: a folder of ``*.safetensors`` files (plus
the model's config), each file identified by an xxh3_128 digest of its bytes, the folder by a
checksum over its (file name, digest) pairs: its manifest.

The digests guard against torn or foreign files (a crashed writer, a half-copied folder, a stale
path), not against an attacker: xxh3 hashes at memory speed, where sha256 would add seconds per
GiB to every refit. The trainer hashes each file's bytes as it writes them (`write_safetensors`:
no file is read back), so its manifest costs nothing extra; a generator checks a folder against
the manifest (`verify_files`) or recomputes the checksum (`checksum_dir`) before loading, hashing
the files in parallel threads (xxhash releases the GIL on large buffers).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from io import FileIO
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

DIGEST_PREFIX = "xxh3_128:"
_CHUNK = 16 << 20  # large reads: xxh3 outruns the disk, so the syscalls are the cost
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page at once, not a fault per page
# Written a piece at a time, each hashed just before it is written: the write then copies bytes
# the hash just brought into the CPU cache (measured: a third to a half of the time of hashing a
# whole tensor, then writing it, two passes over memory).
_WRITE_CHUNK = 1 << 20


class WeightsCorrupted(ValueError):
    """A weights folder does not hold exactly the files of its manifest, with their digests."""


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    return files


def bytes_digest(data: bytes | bytearray | memoryview) -> str:
    """The digest of ``data``, as `file_digest` gives it for a file holding those bytes."""
    return DIGEST_PREFIX + xxhash.xxh3_128(data).hexdigest()


def file_digest(path: str | Path) -> str:
    """The digest of the file's bytes, hashed where they lie in the page cache (a read-only
    mapping, populated up front: half the time of reading them into a buffer, which copies every
    byte once more). A file that cannot be mapped (empty, or not a regular file) is read in
    chunks. Published files are never written after their folder's rename, so the mapping cannot
    lose pages under the hash."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        try:
            mapped = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return _read_digest(fh, h)
        with mapped, memoryview(mapped) as view:
            for offset in range(0, size, _CHUNK):
                h.update(view[offset : offset + _CHUNK])
    return DIGEST_PREFIX + h.hexdigest()


def _read_digest(fh: FileIO, h: xxhash.xxh3_128) -> str:
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while n := fh.readinto(buf):
        h.update(view[:n])
    return DIGEST_PREFIX + h.hexdigest()


def _digests(files: list[Path], max_workers: int | None) -> dict[str, str]:
    workers = min(len(files), max_workers or os.cpu_count() or 1)
    if workers <= 1:
        return {f.name: file_digest(f) for f in files}
    with ThreadPoolExecutor(workers, thread_name_prefix="digest") as pool:
        return dict(zip((f.name for f in files), pool.map(file_digest, files), strict=True))


def folder_digests(path: str | Path, max_workers: int | None = None) -> dict[str, str]:
    """File name -> digest of every safetensors file of the folder, hashed in up to
    ``max_workers`` threads (default: one per CPU)."""
    return _digests(safetensors_files(path), max_workers)


def manifest_checksum(files: Mapping[str, str]) -> str:
    """The folder checksum of a manifest (file name -> digest): an xxh3_128 over its pairs in
    name order."""
    h = xxhash.xxh3_128()
    for name, digest in sorted(files.items()):
        h.update(f"{name}\0{digest}\n".encode())
    return DIGEST_PREFIX + h.hexdigest()


def checksum_dir(path: str | Path) -> str:
    """The checksum of the folder's safetensors files (`manifest_checksum` of their digests)."""
    return manifest_checksum(folder_digests(path))


def verify_files(path: str | Path, files: Mapping[str, str], max_workers: int | None = None) -> None:
    """Check that the folder holds exactly the safetensors files of ``files`` (name -> digest),
    with those digests; raises `WeightsCorrupted` naming the first file (in name order) that is
    missing, unexpected or different."""
    folder = Path(path)
    present = {f.name for f in folder.glob("*.safetensors")}
    for name in sorted(present ^ set(files)):
        what = "missing from" if name in files else "not in the manifest of"
        raise WeightsCorrupted(f"weights file {name!r} is {what} {str(folder)!r}")
    actual = _digests([folder / name for name in sorted(files)], max_workers)
    for name, digest in actual.items():
        if digest != files[name]:
            raise WeightsCorrupted(
                f"weights file {name!r} in {str(folder)!r} has digest {digest}, its manifest says {files[name]}"
            )


def write_hashed(path: str | Path, data: bytes | bytearray | memoryview) -> str:
    """Write ``data`` to ``path``; the digest of what was written (the file is not read back)."""
    digest = bytes_digest(data)
    with open(path, "wb") as fh:
        fh.write(data)
    return digest


_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def write_safetensors(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    consume: bool = False,
) -> str:
    """Write ``tensors`` to ``path`` in the safetensors format, tensor by tensor (the header, then
    each tensor's bytes as they are in memory, a MiB at a time), hashing the bytes as they go out;
    the file's digest.
    No image of the whole file is built and the file is not read back. ``consume`` empties
    ``tensors`` as they are written, so their memory can go early."""
    import json
    import struct

    import torch

    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        kind = _DTYPES.get(str(t.dtype).removeprefix("torch."))
        if kind is None:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": kind, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    h = xxhash.xxh3_128()
    with open(path, "wb") as fh:
        for chunk in (struct.pack("<Q", len(header)), header):
            h.update(chunk)
            fh.write(chunk)
        for name in list(tensors):
            t = tensors.pop(name) if consume else tensors[name]
            if t.numel():
                data = memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
                for offset in range(0, len(data), _WRITE_CHUNK):  # hashed, then written while in cache
                    piece = data[offset : offset + _WRITE_CHUNK]
                    h.update(piece)
                    fh.write(piece)
    return DIGEST_PREFIX + h.hexdigest()


def dir_num_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in safetensors_files(path))

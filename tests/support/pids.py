"""Waiting on processes and files the tests start (never a fixed sleep: a loaded machine takes a
moment to deliver a kill or to write a file)."""

from __future__ import annotations

import asyncio
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie has exited; its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` is gone within ``timeout_s``."""
    for _ in range(int(timeout_s / 0.05)):
        if not alive(pid):
            return True
        await asyncio.sleep(0.05)
    return not alive(pid)


async def text_of(path: Path, timeout_s: float = 120.0) -> str:
    """``path``'s text once something was written to it; TimeoutError after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.05)):
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        await asyncio.sleep(0.05)
    raise TimeoutError(path)

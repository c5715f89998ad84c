"""File copies of a SWE instance: the agent's workspace and the reward run's fresh copy.

* `copy_snapshot`: the snapshot without its ``.git`` (no reward through history) and without
  anything at the hidden tests' destination.
* `build_reward_copy`: a FRESH copy of the snapshot, then the agent's files laid over it (its
  edits, new files and deletions), then the protected files (test configuration, import hooks,
  the files the test patch writes) put back as the snapshot has them, then the hidden tests: the
  hidden folder replaces whatever the agent left at its destination and the test patch is applied.
  What the agent wrote into the hidden tests' place, or into conftest.py, never reaches the run.
  Byte-code caches are dropped so a planted ``.pyc`` cannot stand in for a source file.

Blocking file work, called through ``asyncio.to_thread`` by the runtime and by ``evaluate``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from fnmatch import fnmatchcase
from pathlib import Path

from services.gym_gateway.envs.base import SandboxError
from services.gym_gateway.envs.swe.instance import Instance

_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache"}


def copy_snapshot(instance: Instance, dest: Path) -> None:
    src = Path(instance.repo_dir)
    hidden_top = instance.hidden_tests_dest.split("/")[0]

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in _SKIP_DIRS or n.endswith(".pyc")}
        if Path(folder) == src and hidden_top in names:
            skip.add(hidden_top)
        return skip

    try:
        shutil.copytree(src, dest, symlinks=True, ignore=ignore)
    except (OSError, shutil.Error) as exc:
        raise SandboxError(f"instance {instance.instance_id!r}: cannot copy the snapshot {src}: {exc}") from exc


def files_under(root: Path, *, skip_top: str = "") -> set[str]:
    """Relative posix paths of the files and links under ``root`` (no caches, no .git)."""
    out: set[str] = set()
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        keep = []
        for d in dirs:
            full = Path(folder) / d
            if d in _SKIP_DIRS or (rel_folder == Path(".") and d == skip_top):
                continue
            if full.is_symlink():  # a link to a folder is copied as a link, not walked
                out.add((rel_folder / d).as_posix())
                continue
            keep.append(d)
        dirs[:] = keep
        out.update((rel_folder / f).as_posix() for f in files if not f.endswith(".pyc"))
    return out


def is_protected(rel: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(rel, p) for p in patterns)


def build_reward_copy(instance: Instance, agent_dir: Path, dest: Path, protected: list[str]) -> None:
    copy_snapshot(instance, dest)
    hidden_top = instance.hidden_tests_dest.split("/")[0]
    patterns = list(protected) + instance.patch_targets()
    snapshot = files_under(dest)
    agent = files_under(agent_dir, skip_top=hidden_top)
    try:
        for rel in sorted(snapshot - agent, reverse=True):
            if not is_protected(rel, patterns):
                (dest / rel).unlink()
        for rel in sorted(agent):
            if not is_protected(rel, patterns):
                _place(agent_dir / rel, dest, rel)
        _lay_hidden_tests(instance, dest)
    except OSError as exc:
        raise SandboxError(f"instance {instance.instance_id!r}: cannot build the reward copy: {exc}") from exc
    if instance.test_patch:
        apply_patch(dest, instance.test_patch, what="test_patch")


def _place(src: Path, root: Path, rel: str) -> None:
    """Copy one agent file to ``root/rel``; the agent may have replaced a folder of the snapshot by
    a file or the other way round, so whatever stands in the way goes first."""
    dst = root / rel
    for parent in reversed(Path(rel).parents):
        here = root / parent
        if here.is_symlink() or here.is_file():
            here.unlink()
            break
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    elif dst.exists() or dst.is_symlink():
        dst.unlink()
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst, follow_symlinks=False)


def _lay_hidden_tests(instance: Instance, dest: Path) -> None:
    target = dest / instance.hidden_tests_dest
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    if instance.hidden_tests_dir:
        shutil.copytree(instance.hidden_tests_dir, target, symlinks=True)


def apply_patch(folder: Path, patch: str, *, what: str = "patch") -> None:
    """``git apply`` a unified diff in ``folder``; git's own repository lookup stops there."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_CEILING_DIRECTORIES": str(folder.parent),
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(folder.parent),
    }
    if not patch.endswith("\n"):
        patch += "\n"
    res = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],
        cwd=folder,
        env=env,
        input=patch,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        raise SandboxError(f"cannot apply the {what} in {folder.name}: {res.stderr.strip()[:500]}")

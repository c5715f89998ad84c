"""SWE instances: what one task is, and the loaders that read instances from disk or from rows.

An `Instance` is a repository snapshot (a host folder), a problem statement, hidden tests (a folder
laid into the reward run's copy, and/or a diff applied to it), the status each test must reach,
and the command that runs the tests. Three row formats map onto it:

* native: a folder ``<id>/`` holding ``instance.json``, ``repo/`` (the snapshot) and
  ``hidden_tests/``; ``instance.json`` carries ``problem_statement``, ``expected`` ({test node id:
  status}) and optionally ``test_command``, ``hidden_tests_dest``, ``gold_patch``.
* R2E-Gym rows: ``problem_statement``, ``expected_output_json`` (statuses keyed R2E's way: the node
  id without its file, parts joined by '.'), ``repo_name``, ``docker_image``, ``commit_hash``;
  hidden tests go to ``r2e_tests/`` and the whole test set must match (R2E's reward).
* SWE-bench rows: ``instance_id``, ``repo``, ``problem_statement``, ``FAIL_TO_PASS``,
  ``PASS_TO_PASS``, ``test_patch`` (the hidden tests, applied to the reward copy), ``patch``
  (gold); every listed test must pass, other tests may do anything (SWE-bench's "resolved").

Images cannot be pulled here, so R2E-Gym and SWE-bench rows name a local snapshot with
``repo_dir`` (and R2E rows their hidden tests with ``hidden_tests_dir``); relative paths are
resolved against the rows file's folder. Every error names the file, the row and the field.
Called by the SWE driver (``SweEnv``) and by other drivers through ``swe.load_instances``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import msgspec

# -I: the repository's folder is not put before site-packages, so a `pytest.py` planted by the
# agent cannot stand in for pytest; `-o pythonpath=.` then makes the repository importable.
DEFAULT_TEST_COMMAND = "python3 -I -B -m pytest -rA -p no:cacheprovider -o pythonpath=. {tests}"
STATUSES = frozenset({"PASSED", "FAILED", "ERROR", "XFAIL", "XPASS"})
_PATCH_TARGET = re.compile(r"^\+\+\+ b/(\S+)", re.M)


class InstanceError(ValueError):
    """An instance or row is malformed; the message names the file, the row and the field."""


class Instance(msgspec.Struct, kw_only=True, frozen=True):
    instance_id: str
    problem_statement: str
    repo_dir: str  # host folder of the repository snapshot
    expected: dict[str, str]  # test id -> status the reward run must reach
    test_command: str
    hidden_tests_dir: str = ""  # host folder laid into the reward copy at hidden_tests_dest
    hidden_tests_dest: str = "hidden_tests"  # relative folder; never present in the agent's copy
    test_patch: str = ""  # a diff applied to the reward copy after the agent's files (SWE-bench)
    test_ids: Literal["nodeid", "r2e"] = "nodeid"  # how the test log's lines are keyed
    match: Literal["exact", "expected"] = "exact"  # exact: the run's test set must equal `expected`
    image: str = ""  # container image of the instance (its row's docker_image)
    gold_patch: str = ""  # the reference fix; used by tests and checks, never shown to the agent
    source: Literal["native", "r2e", "swebench"] = "native"

    def patch_targets(self) -> list[str]:
        """Files the test patch writes: the reward run takes them from the snapshot, then patches."""
        return _PATCH_TARGET.findall(self.test_patch)


def load_instances(path: str | Path) -> list[Instance]:
    """Instances from a folder of instance folders, one instance folder, or a JSON (one row or a
    list) / JSONL file of rows. Ids must be unique."""
    path = Path(path)
    if not path.exists():
        raise InstanceError(f"{path}: no such instance folder or rows file")
    if path.is_dir():
        if (path / "instance.json").exists():
            out = [_from_folder(path)]
        else:
            out = [_from_folder(d) for d in sorted(path.iterdir()) if (d / "instance.json").exists()]
            if not out:
                raise InstanceError(f"{path}: no instance folders (folders holding instance.json)")
    else:
        out = [instance_from_row(row, path.parent, where=f"{path} row {i}") for i, row in enumerate(_rows(path))]
    seen: set[str] = set()
    for inst in out:
        if inst.instance_id in seen:
            raise InstanceError(f"{path}: instance_id {inst.instance_id!r} appears twice")
        seen.add(inst.instance_id)
    return out


def instance_from_row(row: dict[str, Any], base_dir: str | Path, *, where: str = "row") -> Instance:
    """One row of any of the three formats (R2E-Gym if it has ``expected_output_json``, SWE-bench
    if it has ``FAIL_TO_PASS``, else native); relative paths are resolved against ``base_dir``."""
    if not isinstance(row, dict):
        raise InstanceError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    base = Path(base_dir)
    if "expected_output_json" in row:
        return _from_r2e(row, base, where)
    if "FAIL_TO_PASS" in row:
        return _from_swebench(row, base, where)
    if "instance_dir" in row:
        return _from_folder(_path(base, _str(row, "instance_dir", where)))
    return _from_native(row, base, where)


def _rows(path: Path) -> list[Any]:
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InstanceError(f"{path}: not valid JSON: {exc}") from exc
    return data if isinstance(data, list) else [data]


def _from_folder(folder: Path) -> Instance:
    where = str(folder / "instance.json")
    try:
        row = json.loads((folder / "instance.json").read_text())
    except json.JSONDecodeError as exc:
        raise InstanceError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(row, dict):
        raise InstanceError(f"{where}: must hold a JSON object")
    row.setdefault("instance_id", folder.name)
    row.setdefault("repo_dir", "repo")
    if (folder / "hidden_tests").is_dir():
        row.setdefault("hidden_tests_dir", "hidden_tests")
    return _from_native(row, folder, where)


def _from_native(row: dict[str, Any], base: Path, where: str) -> Instance:
    expected = _statuses(row.get("expected"), "expected", where)
    dest = _rel(row.get("hidden_tests_dest", "hidden_tests"), "hidden_tests_dest", where)
    hidden = row.get("hidden_tests_dir") or ""
    if not hidden and not row.get("test_patch"):
        raise InstanceError(
            f"{where}: missing field 'hidden_tests_dir' (or 'test_patch'): an instance needs hidden tests"
        )
    return Instance(
        instance_id=_str(row, "instance_id", where),
        problem_statement=_str(row, "problem_statement", where),
        repo_dir=str(_path(base, _str(row, "repo_dir", where))),
        expected=expected,
        test_command=row.get("test_command") or DEFAULT_TEST_COMMAND.format(tests=dest),
        hidden_tests_dir=str(_path(base, hidden)) if hidden else "",
        hidden_tests_dest=dest,
        test_patch=row.get("test_patch") or "",
        test_ids=_choice(row, "test_ids", ("nodeid", "r2e"), where),
        match=_choice(row, "match", ("exact", "expected"), where),
        image=row.get("docker_image") or row.get("image") or "",
        gold_patch=row.get("gold_patch") or "",
    )


def _from_r2e(row: dict[str, Any], base: Path, where: str) -> Instance:
    raw = row["expected_output_json"]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{where}: field 'expected_output_json' is not valid JSON: {exc}") from exc
    repo_name = _str(row, "repo_name", where)
    commit = str(row.get("commit_hash") or "")
    ident = row.get("instance_id") or (f"{repo_name}@{commit[:12]}" if commit else repo_name)
    _need_snapshot(row, where, "R2E-Gym", ("repo_dir", "hidden_tests_dir"))
    return Instance(
        instance_id=str(ident),
        problem_statement=_str(row, "problem_statement", where),
        repo_dir=str(_path(base, _str(row, "repo_dir", where))),
        expected=_statuses(raw, "expected_output_json", where),
        test_command=row.get("test_command") or DEFAULT_TEST_COMMAND.format(tests="r2e_tests"),
        hidden_tests_dir=str(_path(base, _str(row, "hidden_tests_dir", where))),
        hidden_tests_dest="r2e_tests",
        test_ids="r2e",
        match="exact",
        image=row.get("docker_image") or "",
        gold_patch=row.get("patch") or "",
        source="r2e",
    )


def _from_swebench(row: dict[str, Any], base: Path, where: str) -> Instance:
    fail_to_pass = _test_list(row, "FAIL_TO_PASS", where)
    pass_to_pass = _test_list(row, "PASS_TO_PASS", where)
    test_patch = _str(row, "test_patch", where)
    _need_snapshot(row, where, "SWE-bench", ("repo_dir",))
    files = sorted(set(_PATCH_TARGET.findall(test_patch)))
    if not files:
        raise InstanceError(f"{where}: field 'test_patch' changes no file (no '+++ b/<path>' line)")
    return Instance(
        instance_id=_str(row, "instance_id", where),
        problem_statement=_str(row, "problem_statement", where),
        repo_dir=str(_path(base, _str(row, "repo_dir", where))),
        expected={t: "PASSED" for t in fail_to_pass + pass_to_pass},
        test_command=row.get("test_command") or DEFAULT_TEST_COMMAND.format(tests=" ".join(files)),
        test_patch=test_patch,
        test_ids="nodeid",
        match="expected",
        image=row.get("docker_image") or row.get("image") or "",
        gold_patch=row.get("patch") or "",
        source="swebench",
    )


def _need_snapshot(row: dict[str, Any], where: str, kind: str, fields: tuple[str, ...]) -> None:
    for name in fields:
        if not row.get(name):
            image = row.get("docker_image") or "its image"
            raise InstanceError(
                f"{where}: missing field {name!r}: a {kind} row needs a local copy of what {image} holds "
                f"(images cannot be pulled here); set {name!r} to that folder"
            )


def _str(row: dict[str, Any], name: str, where: str) -> str:
    if name not in row or row[name] in (None, ""):
        raise InstanceError(f"{where}: missing field {name!r}")
    value = row[name]
    if not isinstance(value, str):
        raise InstanceError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _statuses(raw: Any, name: str, where: str) -> dict[str, str]:
    if raw is None:
        raise InstanceError(f"{where}: missing field {name!r}")
    if not isinstance(raw, dict) or not raw:
        raise InstanceError(f"{where}: field {name!r} must be a non-empty object {{test: status}}")
    for test, status in raw.items():
        if status not in STATUSES:
            raise InstanceError(
                f"{where}: field {name!r}: test {test!r} has status {status!r}; "
                f"one of {', '.join(sorted(STATUSES))} expected"
            )
    return dict(raw)


def _choice(row: dict[str, Any], name: str, choices: tuple[str, ...], where: str) -> Any:
    value = row.get(name, choices[0])
    if value not in choices:
        raise InstanceError(f"{where}: field {name!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _test_list(row: dict[str, Any], name: str, where: str) -> list[str]:
    if name not in row:
        raise InstanceError(f"{where}: missing field {name!r}")
    raw = row[name]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{where}: field {name!r} is not a JSON list: {exc}") from exc
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise InstanceError(f"{where}: field {name!r} must be a list of test ids")
    return raw


def _rel(value: Any, name: str, where: str) -> str:
    p = Path(str(value))
    if not str(value) or p.is_absolute() or ".." in p.parts:
        raise InstanceError(f"{where}: field {name!r} must be a relative folder inside the repository, got {value!r}")
    return p.as_posix()


def _path(base: Path, value: str) -> Path:
    p = Path(value)
    return (p if p.is_absolute() else base / p).resolve()

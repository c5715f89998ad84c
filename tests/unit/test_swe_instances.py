"""SWE driver, pure parts: the instance loaders (native folders, R2E-Gym and SWE-bench rows) and
their errors, the pytest summary parser and status comparison, output capping, the editor tool,
and the config section."""

import json
from pathlib import Path

import pytest

from services.gym_gateway.envs.base import SandboxError
from services.gym_gateway.envs.swe import (
    InstanceError,
    LocalRuntime,
    Workspace,
    instance_from_row,
    load_instances,
    parse_test_log,
)
from services.gym_gateway.envs.swe.agent import SHIPPED_INSTANCES, SweEnv
from services.gym_gateway.envs.swe.evaluate import compare
from services.gym_gateway.envs.swe.runtime import _Capped
from services.gym_gateway.envs.swe.tools import edit, resolve, run_tool
from shared.config import load
from shared.config_error import ConfigError
from shared.run_config import RunConfig
from shared.sections.env_swe import SweSection

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "tests" / "data" / "swe"

PYTEST_LOG = """\
============================= test session starts ==============================
collected 6 items

r2e_tests/test_a.py ..F.Es                                               [100%]
==================================== ERRORS ====================================
=========================== short test summary info ============================
PASSED r2e_tests/test_a.py::test_one
PASSED r2e_tests/test_a.py::TestK::test_two[1-x]
FAILED r2e_tests/test_a.py::TestK::test_three - AssertionError: assert 1 == 2
PASSED r2e_tests/test_a.py::test_four
ERROR r2e_tests/test_a.py::test_five - fixture 'db' not found
SKIPPED [1] r2e_tests/test_a.py:30: no network
XFAIL r2e_tests/test_a.py::test_six - known bug
=========== 1 failed, 3 passed, 1 skipped, 1 xfailed, 1 error in 0.05s ===========
"""


def test_shipped_instances_are_complete():
    instances = load_instances(SHIPPED_INSTANCES)
    assert len(instances) >= 4
    for inst in instances:
        assert Path(inst.repo_dir, ".").is_dir() and Path(inst.hidden_tests_dir).is_dir()
        assert inst.expected and set(inst.expected.values()) == {"PASSED"}
        assert all(t.startswith("hidden_tests/") for t in inst.expected)
        assert inst.gold_patch.startswith("diff --git") and inst.problem_statement
        assert "pytest -rA" in inst.test_command and inst.test_command.endswith(" hidden_tests")
        # the hidden tests live outside the snapshot
        assert not Path(inst.repo_dir, inst.hidden_tests_dest).exists()


def test_r2e_row_maps_onto_an_instance():
    [inst] = load_instances(ROWS / "r2e_row.json")
    assert inst.source == "r2e" and inst.instance_id == "structs@9c1d2e3f4a5b"
    assert inst.image == "namanjain12/structsnew:9c1d2e3f4a5b"
    assert inst.expected == {
        "TestStack.test_push_pop_order": "PASSED",
        "TestStack.test_peek_returns_top": "PASSED",
        "TestStack.test_peek_empty_raises": "PASSED",
    }
    assert inst.test_ids == "r2e" and inst.match == "exact" and inst.hidden_tests_dest == "r2e_tests"
    assert inst.test_command.endswith(" r2e_tests")
    assert Path(inst.repo_dir) == SHIPPED_INSTANCES / "stack-peek-empty" / "repo"  # relative to the rows file
    assert Path(inst.hidden_tests_dir) == SHIPPED_INSTANCES / "stack-peek-empty" / "hidden_tests"


def test_swebench_row_maps_onto_an_instance():
    [inst] = load_instances(ROWS / "swebench_row.json")
    row = json.loads((ROWS / "swebench_row.json").read_text())
    assert inst.source == "swebench" and inst.instance_id == "example__textkit-17"
    assert inst.expected == {
        "tests/test_slug.py::test_collapses_runs_of_separators": "PASSED",
        "tests/test_slug.py::test_strips_leading_and_trailing_separators": "PASSED",
        "tests/test_slug.py::test_single_word": "PASSED",
    }
    assert inst.match == "expected" and inst.test_ids == "nodeid" and not inst.hidden_tests_dir
    assert inst.test_patch == row["test_patch"] and inst.patch_targets() == ["tests/test_slug.py"]
    assert inst.test_command.endswith(" tests/test_slug.py") and inst.gold_patch == row["patch"]


def test_jsonl_of_mixed_rows_and_duplicate_ids(tmp_path):
    rows = [json.loads((ROWS / n).read_text()) for n in ("r2e_row.json", "swebench_row.json")]
    for row in rows:  # paths relative to the new file's folder
        for key in ("repo_dir", "hidden_tests_dir"):
            if key in row:
                row[key] = str((ROWS / row[key]).resolve())
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [i.source for i in load_instances(f)] == ["r2e", "swebench"]
    f.write_text("\n".join(json.dumps(r) for r in rows + rows[:1]) + "\n")
    with pytest.raises(InstanceError, match="'structs@9c1d2e3f4a5b' appears twice"):
        load_instances(f)


def _r2e_row(**changes):
    row = json.loads((ROWS / "r2e_row.json").read_text())
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"problem_statement": None}, "missing field 'problem_statement'"),
        ({"repo_name": None}, "missing field 'repo_name'"),
        ({"expected_output_json": "{not json"}, "'expected_output_json' is not valid JSON"),
        ({"expected_output_json": "{}"}, "'expected_output_json' must be a non-empty object"),
        ({"expected_output_json": json.dumps({"t": "GREEN"})}, "test 't' has status 'GREEN'"),
        ({"repo_dir": None}, "missing field 'repo_dir'.*namanjain12/structsnew.*cannot be pulled"),
        ({"hidden_tests_dir": None}, "missing field 'hidden_tests_dir'"),
    ],
)
def test_r2e_row_errors_name_the_field(changes, message):
    with pytest.raises(InstanceError, match=message):
        instance_from_row(_r2e_row(**changes), ROWS, where="rows.json row 3")
    with pytest.raises(InstanceError, match="rows.json row 3"):
        instance_from_row(_r2e_row(**changes), ROWS, where="rows.json row 3")


@pytest.mark.parametrize(
    "drop,value,message",
    [
        ("PASS_TO_PASS", None, "missing field 'PASS_TO_PASS'"),
        ("instance_id", None, "missing field 'instance_id'"),
        ("FAIL_TO_PASS", "[1, 2]", "'FAIL_TO_PASS' must be a list of test ids"),
        ("test_patch", "no diff here", "'test_patch' changes no file"),
        ("test_patch", None, "missing field 'test_patch'"),
    ],
)
def test_swebench_row_errors_name_the_field(drop, value, message):
    row = json.loads((ROWS / "swebench_row.json").read_text())
    if value is None:
        del row[drop]
    else:
        row[drop] = value
    with pytest.raises(InstanceError, match=message):
        instance_from_row(row, ROWS)


def test_native_folder_errors(tmp_path):
    d = tmp_path / "one"
    (d / "repo").mkdir(parents=True)
    (d / "instance.json").write_text(json.dumps({"problem_statement": "p", "expected": {"t::a": "PASSED"}}))
    with pytest.raises(InstanceError, match="missing field 'hidden_tests_dir'"):
        load_instances(tmp_path)
    (d / "hidden_tests").mkdir()
    [inst] = load_instances(tmp_path)
    assert inst.instance_id == "one" and inst.repo_dir == str(d / "repo")
    (d / "instance.json").write_text(
        json.dumps({"problem_statement": "p", "expected": {"t::a": "PASSED"}, "hidden_tests_dest": "../outside"})
    )
    with pytest.raises(InstanceError, match="'hidden_tests_dest' must be a relative folder"):
        load_instances(d)
    (d / "instance.json").write_text(
        json.dumps({"problem_statement": "p", "expected": {"t::a": "PASSED"}, "match": "some"})
    )
    with pytest.raises(InstanceError, match="'match' must be one of exact, expected"):
        load_instances(d)
    (d / "instance.json").write_text("[1,")
    with pytest.raises(InstanceError, match="instance.json: not valid JSON"):
        load_instances(d)
    with pytest.raises(InstanceError, match="no such instance folder"):
        load_instances(tmp_path / "nope")
    with pytest.raises(InstanceError, match="a row must be a JSON object"):
        instance_from_row(["x"], tmp_path)


def test_parse_pytest_summary_by_node_id_and_r2e_key():
    assert parse_test_log(PYTEST_LOG) == {
        "r2e_tests/test_a.py::test_one": "PASSED",
        "r2e_tests/test_a.py::TestK::test_two[1-x]": "PASSED",
        "r2e_tests/test_a.py::TestK::test_three": "FAILED",
        "r2e_tests/test_a.py::test_four": "PASSED",
        "r2e_tests/test_a.py::test_five": "ERROR",
        "r2e_tests/test_a.py::test_six": "XFAIL",
    }
    r2e = parse_test_log("\x1b[32m" + PYTEST_LOG.replace("PASSED r2e", "\x1b[32mPASSED\x1b[0m r2e"), "r2e")
    assert (
        r2e["TestK.test_two[1-x]"] == "PASSED" and r2e["TestK.test_three"] == "FAILED" and r2e["test_one"] == "PASSED"
    )
    assert parse_test_log("collected 0 items\nno tests ran") == {}


def test_only_the_last_summary_counts():
    fake = "=== short test summary info ===\nPASSED t.py::test_x\n"
    real = "=== short test summary info ===\nFAILED t.py::test_x - boom\n"
    assert parse_test_log(fake + "more output\n" + real) == {"t.py::test_x": "FAILED"}


def test_compare_exact_and_expected():
    expected = {"a": "PASSED", "b": "FAILED"}
    assert compare({"a": "PASSED", "b": "FAILED"}, expected, "exact") == []
    assert compare({"a": "PASSED", "b": "PASSED"}, expected, "exact") == ["b"]
    assert compare({"a": "PASSED"}, expected, "exact") == ["b"]
    assert compare({"a": "PASSED", "b": "FAILED", "c": "PASSED"}, expected, "exact") == ["c"]
    assert compare({"a": "PASSED", "b": "FAILED", "c": "FAILED"}, expected, "expected") == []


def test_capped_output_keeps_head_and_tail():
    buf = _Capped(100)
    for i in range(1000):
        buf.add(f"{i:04d}".encode())
    text = buf.text()
    assert text.startswith("0000000100020003") and text.endswith("0996099709980999")
    assert len(text) < 200
    assert "[... 3900 bytes of output cut ...]" in text
    small = _Capped(100)
    small.add(b"short")
    assert small.text() == "short"


@pytest.fixture
def ws(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("a = 1\nb = 2\nb = 2\n")
    (tmp_path / "secret.txt").write_text("hidden")
    return Workspace(None, None, repo, "/testbed", tmp_path / "home")


def test_editor_views_creates_and_replaces(ws):
    assert "     1\ta = 1" in edit(ws, {"command": "view", "path": "pkg/mod.py"})
    assert edit(ws, {"command": "view", "path": "/testbed/pkg/mod.py", "view_range": [2, 2]}) == "     2\tb = 2"
    assert "/testbed/pkg/mod.py" in edit(ws, {"command": "view", "path": "."})
    assert edit(ws, {"command": "create", "path": "pkg/new.py", "file_text": "x = 1\n"}).startswith("Created")
    assert (ws.path / "pkg" / "new.py").read_text() == "x = 1\n"
    out = edit(ws, {"command": "str_replace", "path": "pkg/mod.py", "old_str": "a = 1", "new_str": "a = 10"})
    assert "a = 10" in out and (ws.path / "pkg" / "mod.py").read_text().startswith("a = 10\n")


async def test_bad_tool_calls_are_tool_output_not_errors(ws):
    cases = [
        (
            "str_replace_editor",
            {"command": "str_replace", "path": "pkg/mod.py", "old_str": "b = 2", "new_str": "c"},
            "occurs 2 times",
        ),
        (
            "str_replace_editor",
            {"command": "str_replace", "path": "pkg/mod.py", "old_str": "zzz", "new_str": "c"},
            "occurs 0 times",
        ),
        ("str_replace_editor", {"command": "create", "path": "pkg/mod.py", "file_text": ""}, "exists"),
        ("str_replace_editor", {"command": "view", "path": "../secret.txt"}, "outside the repository"),
        ("str_replace_editor", {"command": "view", "path": "/etc/passwd"}, "outside the repository"),
        ("file_editor", {"command": "delete", "path": "pkg/mod.py"}, "unknown command 'delete'"),
        ("execute_bash", {}, "non-empty 'command'"),
        ("browse", {}, "unknown tool 'browse'"),
        ("execute_bash", "{not json", "not valid JSON"),
    ]
    for name, args, message in cases:
        out, done = await run_tool(ws, name, args if isinstance(args, str) else json.dumps(args))
        assert out.startswith("error:") and message in out and not done, (name, out)
    assert await run_tool(ws, "finish", "{}") == ("Submitted.", True)
    assert (ws.path / "pkg" / "mod.py").read_text() == "a = 1\nb = 2\nb = 2\n"


def test_resolve_follows_links_out_of_the_workspace(ws):
    (ws.path / "link").symlink_to(ws.path.parent)
    with pytest.raises(Exception, match="outside the repository"):
        resolve(ws, "link/secret.txt")


def test_config_section_and_registry(tmp_path):
    cfg = load(
        RunConfig,
        None,
        ["policy.model_name=m", "data.train_path=t.jsonl", "env.swe.runtime=podman", "env.swe.command_timeout_s=5"],
        env={},
    )
    assert cfg.env.swe.runtime == "podman" and cfg.env.swe.command_timeout_s == 5.0
    assert "conftest.py" in cfg.env.swe.protected_paths
    with pytest.raises(ConfigError, match="env.swe.runtime"):
        load(RunConfig, None, ["policy.model_name=m", "data.train_path=t.jsonl", "env.swe.runtime=vm"], env={})
    from services.gym_gateway.envs import get_env

    env = get_env("swe", cfg.env)
    assert isinstance(env, SweEnv) and env.runtime.kind == "podman"
    rows = env.make_instances(12, seed=3)
    assert len(rows) == 12 and {r["instance_id"] for r in rows} == set(env.instances())
    with pytest.raises(InstanceError, match="'nope' is not in env.swe.instances_path"):
        env.resolve({"instance_id": "nope"})


async def test_missing_snapshot_is_a_sandbox_error(tmp_path):
    inst = instance_from_row(
        {
            "instance_id": "x",
            "problem_statement": "p",
            "repo_dir": "gone",
            "hidden_tests_dir": "h",
            "expected": {"t::a": "PASSED"},
        },
        tmp_path,
    )
    with pytest.raises(SandboxError, match="repository snapshot .*gone.* is not a folder"):
        async with LocalRuntime(SweSection()).workspace(inst):
            pass

"""BENCHMARKS.md and the results it is rendered from (benchmarks/<section>.json): every stored
section decodes into its struct and renders, the file is exactly the rendering of the stored
results (it cannot drift from its data), sections sit in the report's order, a section measured
alone replaces only itself, and the prose is wrapped."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from streamrl.bench import suite
from streamrl.bench.report import WIDTH, load, reflow, save, wrap_words
from streamrl.cli import app

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "benchmarks"
HEADINGS = {
    "demo": "## Demo run",
    "demo_variants": "## Demo variants",
    "streams": "## Stream transport",
    "generator": "## Generator",
    "gateway": "## Gym gateway",
    "gateway_scale": "## Session proxy at scale",
    "openhands": "## OpenHands runners",
    "trainer": "## Trainer",
    "refit": "## Refit",
    "reshard": "## Refit without a gather",
    "multihost": "## Beyond one host",
    "pipeline": "## Pipeline efficiency",
    "routing_replay": "## MoE routing replay",
    "autoscale": "## A run that sizes itself",
    "tracing": "## Tracing",
}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A copy of the stored results to change."""
    shutil.copytree(STORED, tmp_path / "benchmarks")
    return tmp_path / "benchmarks"


def _sections(text: str) -> dict[str, str]:
    """Each ``## `` heading's section, to the next one."""
    out: dict[str, str] = {}
    for part in text.split("\n## ")[1:]:
        out["## " + part.split("\n", 1)[0]] = part
    return out


def _headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


@pytest.mark.parametrize("section", suite.REPORT, ids=lambda s: s.name)
def test_every_stored_section_decodes_into_its_struct_and_renders(section: suite.Section):
    results = load(STORED / f"{section.name}.json", section.results)
    text = section.render(results)
    assert _headings(text) == [HEADINGS[section.name]]
    assert msgspec.json.decode(msgspec.json.encode(results), type=section.results) == results


def test_benchmarks_md_is_the_rendering_of_the_stored_results():
    assert suite.render_report(STORED) == (ROOT / "BENCHMARKS.md").read_text()
    assert sorted(p.stem for p in STORED.glob("*.json")) == sorted([suite.SUITE, *HEADINGS])


def test_sections_follow_the_reports_order_whichever_are_stored(store: Path):
    assert _headings(suite.render_report(store)) == list(HEADINGS.values())
    gone = ("generator", "demo_variants", "trainer", "refit", "pipeline")
    for name in gone:
        (store / f"{name}.json").unlink()
    kept = [h for n, h in HEADINGS.items() if n not in gone]
    assert _headings(suite.render_report(store)) == kept
    shutil.copy(STORED / "refit.json", store / "refit.json")  # after the trainer's place, before the pipeline's
    assert _headings(suite.render_report(store)) == [h for n, h in HEADINGS.items() if n not in gone or n == "refit"]


def test_a_section_measured_alone_replaces_only_itself(store: Path, tmp_path: Path, monkeypatch):
    before = suite.render_report(store)
    stored = load(store / "generator.json", suite.BY_NAME["generator"].results)
    remeasured = msgspec.structs.replace(stored, date="2027-01-02")
    monkeypatch.setattr(suite, "measure", lambda name, valkey, machine: (remeasured, []))
    out = tmp_path / "BENCHMARKS.md"
    assert suite.run_benchmarks(out, only="generator", results_dir=store) == 0
    assert load(store / "generator.json", type(remeasured)) == remeasured
    old, new = _sections(before), _sections(out.read_text())
    assert list(old) == list(new)
    assert [h for h in old if old[h] != new[h]] == [HEADINGS["generator"]]
    assert "Measured on 2027-01-02" in new[HEADINGS["generator"]]
    assert suite.render_report(store) == out.read_text()  # rendering again changes nothing


def test_a_failed_run_of_the_section_fails_the_command(store: Path, tmp_path: Path, monkeypatch):
    results = load(store / "demo_variants.json", suite.BY_NAME["demo_variants"].results)
    monkeypatch.setattr(suite, "measure", lambda name, valkey, machine: (results, [0, 1, 0]))
    assert suite.run_benchmarks(tmp_path / "B.md", only="demo_variants", results_dir=store) == 1
    with pytest.raises(ValueError, match="unknown bench section"):
        suite.run_benchmarks(tmp_path / "B.md", only="demo", results_dir=store)


def test_render_rewrites_the_report_from_the_stored_results(store: Path, tmp_path: Path):
    out = tmp_path / "B.md"
    result = CliRunner().invoke(app, ["bench", "--render", "--results", str(store), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (ROOT / "BENCHMARKS.md").read_text()
    refused = CliRunner().invoke(app, ["bench", "--render", "--only", "generator", "--out", str(out)])
    assert refused.exit_code != 0


def test_prose_is_wrapped_and_table_rows_are_whole():
    for line in (ROOT / "BENCHMARKS.md").read_text().splitlines():
        assert line.startswith("|") or len(line) <= WIDTH, line
    long = "word " * 40 + "a burst of n waits for the work on the n - 1 before it"
    assert all(len(line) <= WIDTH for line in reflow(long).splitlines())
    assert reflow("| a | b |\n|---|---|\n") == "| a | b |\n|---|---|\n"


def test_no_wrapped_line_starts_with_markdown_syntax():
    for n in range(1, 12):
        words = ["x" * 7] * n + ["-", "1", "+", "2", ">=", "3", "#4", "5."] * 3
        lines = wrap_words(words, width=20)
        assert [w for line in lines for w in line.split()] == words
        assert not any(line.split()[0] in ("-", "+", ">=", "#4", "5.") for line in lines[1:])


def test_a_stored_file_with_an_unknown_key_is_refused(store: Path):
    path = store / "streams.json"
    path.write_bytes(path.read_bytes().replace(b'"packed"', b'"packd"', 1))
    with pytest.raises(msgspec.ValidationError, match="packd"):
        load(path, suite.BY_NAME["streams"].results)
    save(path, load(STORED / "streams.json", suite.BY_NAME["streams"].results))
    assert path.read_bytes() == (STORED / "streams.json").read_bytes()

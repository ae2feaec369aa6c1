"""Every figure table in README.md and docs/*.md is rendered from the results ledger
(``benchmarks/results/ledger/``, written by ``benchmarks/common.py: record_run``), and a table edited
by hand fails here. Also: goals are judged in code from the unrounded value, and quick runs never
reach the committed ledger. No Ray."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RENDER = _load("render_docs", REPO / "scripts" / "render_docs.py")
COMMON = _load("benchmarks_common", REPO / "benchmarks" / "common.py")


def test_every_doc_table_matches_its_ledger_entry():
    problems = RENDER.check(RENDER.doc_paths())
    assert not problems, "\n".join(problems)


def test_the_docs_render_the_tables_the_issue_names():
    text = "\n".join(p.read_text() for p in RENDER.doc_paths())
    sources = {m.group("source") for m in RENDER.BLOCK.finditer(text)}
    assert {"serving.router_replay", "train_scaling.platform_vs_bare", "serving_vllm.default",
            "serving_vllm.pressure", "handover.phases", "colocation.offered_loads"} <= sources


def test_a_table_edited_by_hand_fails_the_check(tmp_path):
    copies = []
    for path in RENDER.doc_paths():
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        copies.append(copy)
    assert not RENDER.check(copies)
    doc = next(c for c in copies if "<!-- ledger: serving.router_replay -->" in c.read_text())
    text = doc.read_text()
    start = text.index("<!-- ledger: serving.router_replay -->")
    row = text.index("\n| ", text.index("|---", start)) + 1  # the first data row
    cells = text[row:text.index("\n", row)].split(" | ")
    cells[2] = "0.999 / 0.999 / 0.999"  # a share nobody measured
    doc.write_text(text[:row] + " | ".join(cells) + text[text.index("\n", row):])
    problems = RENDER.check(copies)
    assert len(problems) == 1 and "serving.router_replay" in problems[0]


def test_a_block_naming_a_missing_ledger_fails(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("<!-- ledger: no_such_benchmark.table -->\n| a |\n|---|\n<!-- /ledger -->\n")
    assert RENDER.check([doc])


def test_goals_are_judged_on_the_unrounded_value():
    Goal = COMMON.Goal
    assert Goal("ratio", ">=", 0.97, 0.967).met is False  # prints as 0.97, misses 0.97
    assert Goal("ratio", ">=", 0.97, 0.9701).met is True
    assert Goal("load", "<=", 1.1, 1.1004).met is False
    # A figure known only as printed (0.97, two decimals) cannot be judged against 0.97.
    assert Goal("ratio", ">=", 0.97, 0.97, printed_halfwidth=0.005).met is None
    assert Goal("ratio", ">=", 0.97, 1.03, printed_halfwidth=0.005).met is True
    assert Goal("ratio", ">=", 0.97, None).met is None


def test_every_ledger_entry_is_complete_and_its_verdicts_recompute():
    ledger = REPO / "benchmarks" / "results" / "ledger"
    files = sorted(ledger.glob("*.jsonl"))
    assert files, "the committed ledger is empty"
    for path in files:
        for entry in COMMON.read_ledger(path):
            assert entry["benchmark"] == path.stem
            assert entry["mode"] == "full", f"{path.name}: a quick run in the committed ledger"
            assert {"recorded_at", "provenance", "git", "machine", "params", "figures", "goals", "tables"} <= set(entry)
            if entry["provenance"] == "measured":
                assert entry["git"]["commit"] and entry["machine"]["cores"] and entry["machine"]["load_avg_before"]
            else:
                assert "not re-measured" in entry["provenance"]
            for g in entry["goals"]:
                again = COMMON.Goal(g["name"], g["comparator"], g["threshold"], g["value"],
                                    g.get("printed_halfwidth", 0.0))
                assert again.met == g["met"], f"{path.name}: {g['name']}"


def test_record_run_keeps_quick_runs_out_of_the_committed_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv(COMMON.LEDGER_DIR_ENV, str(tmp_path))
    table = COMMON.Table(["a", "b"], [["1", "2"]])
    quick = COMMON.record_run(name="demo_bench", quick=True, params={"n": 1}, figures={"x": 0.5, "samples": list(range(500))},
                              goals=[COMMON.Goal("x", "<=", 1.0, 0.5)], tables={"t": table}, argv=["--quick"])
    full = COMMON.record_run(name="demo_bench", quick=False, params={"n": 2}, figures={"x": 0.7}, argv=[])
    assert quick == tmp_path / "quick" / "demo_bench.jsonl" and full == tmp_path / "ledger" / "demo_bench.jsonl"
    entry = json.loads(quick.read_text())
    assert entry["mode"] == "quick" and entry["goals"][0]["met"] is True
    assert entry["figures"]["samples"] == {"omitted_list_of": 500}  # samples stay in --json, not the ledger
    assert [e["mode"] for e in COMMON.read_ledger(full)] == ["full"]
    # The renderer reads only full runs: the quick entry's table is invisible to the docs.
    with pytest.raises(LookupError):
        RENDER.newest("demo_bench", "t", tmp_path / "ledger")


def test_git_ignores_everything_under_results_but_the_ledger():
    ignore = (REPO / ".gitignore").read_text().splitlines()
    assert "benchmarks/results/*" in ignore and "!benchmarks/results/ledger/" in ignore

"""Stored evaluations in the views: `explain` lists a merge's, `diff` compares two on shared data, `lineage` shows
each model's scores on the data that compares the most of them; text, --json and --html alike, and nothing at
all where nothing was evaluated. Rows are written with ``catalog.evaluations.add`` and values picked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import EvaluationRecord
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.fixtures.cli import invoke, wide_runner
from tests.planner.support import build_catalog, clone_catalog

WIKI, CODE, OTHER = "1" * 64, "2" * 64, "3" * 64
NAMES = {WIKI: "wiki.txt", CODE: "code.txt", OTHER: "arc_easy"}


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    """Two versions of merged model 'm' (m@1, m@2) of base, e1, e2; nothing evaluated."""
    root = tmp_path_factory.mktemp("evaluated")
    db = build_catalog(root / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")},
                       base="base", experts=["e1", "e2"])
    with Catalog.open(db) as catalog:
        for weights, out in (([1.0, 1.0], "v1"), ([0.5, 1.0], "v2")):
            made = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic",
                                                      weights=weights))
            Engine(catalog).execute(made, out=root / out, model_id="m")
    return root, db


def plan_digest(folder: Path) -> str:
    """The plan digest a snapshot's manifest names: what its scores are stored under."""
    return json.loads((folder / "manifest.json").read_text())["plan_digest"]


def row(subject: str, kind: str, data: str, metric: str, value: float, tokens: int | None = 4096,
        created_at: str = "2026-12-06T10:00:00+00:00") -> EvaluationRecord:
    return EvaluationRecord(subject=subject, subject_kind=kind, data_digest=data, data_name=NAMES[data],
                            metric=metric, value=value, tokens=tokens, versions={"mergepipe": "1.0"}, device="cpu",
                            seconds=2.0, created_at=created_at)


@pytest.fixture
def evaluated(template, tmp_path):
    """The template's catalog with scores: m@1 and m@2 on wiki.txt (and one data each of their own), the base on
    wiki.txt; e1 and e2 never evaluated."""
    root, db = template
    db = clone_catalog(db, tmp_path / "c.db")
    v1, v2 = plan_digest(root / "v1"), plan_digest(root / "v2")
    with Catalog.open(db) as catalog:
        base = catalog.blocks.content_fingerprint("base")
        rows = {
            "v1": [row(v1, "plan", WIKI, "loss", 2.5), row(v1, "plan", WIKI, "perplexity", 12.25),
                   row(v1, "plan", CODE, "loss", 1.75, tokens=None)],
            "v2": [row(v2, "plan", WIKI, "loss", 2.25, created_at="2026-12-06T11:00:00+00:00"),
                   row(v2, "plan", WIKI, "perplexity", 9.5, created_at="2026-12-06T11:00:00+00:00"),
                   row(v2, "plan", OTHER, "arc_easy/acc", 0.5, tokens=None, created_at="2026-12-06T12:00:00+00:00")],
            "base": [row(base, "model", WIKI, "loss", 3.0)],
        }
        catalog.evaluations.add([r for group in rows.values() for r in group])
    return db, root, rows


def cells(text: str) -> list[list[str]]:
    """The rows of every rich table in ``text``, as stripped cells."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.count("│") >= 2]


def test_explain_lists_the_merges_scores_for_its_snapshot_and_its_plan(evaluated, monkeypatch, tmp_path):
    db, root, rows = evaluated
    runner = wide_runner(monkeypatch)
    text = invoke(runner, ["explain", "--db", db, "m@1"])
    assert "evaluations (of plan" in text
    table = [c for c in cells(text) if c and c[0] in NAMES.values()]
    assert table == [["code.txt", CODE[:12], "loss", "1.75", "-"], ["wiki.txt", WIKI[:12], "loss", "2.5", "4096"],
                     ["wiki.txt", WIKI[:12], "perplexity", "12.25", "4096"]]
    as_json = json.loads(invoke(runner, ["explain", "--db", db, "m@1", "--json"]))
    expected = sorted((r.model_dump() for r in rows["v1"]), key=lambda r: (r["data_name"], r["metric"]))
    assert as_json["evaluations"] == expected
    # the plan (not the snapshot) has the same subject: the same rows
    by_plan = json.loads(invoke(runner, ["explain", "--db", db, plan_digest(root / "v1")[:16], "--json"]))
    assert by_plan["snapshot_id"] is None and by_plan["evaluations"] == expected
    page = tmp_path / "explain.html"
    invoke(runner, ["explain", "--db", db, "m@1", "--html", page])
    html = page.read_text(encoding="utf-8")
    assert '<section id="evaluations"><h2>Evaluations</h2>' in html
    for r in rows["v1"]:
        assert f'<td class="name mono">{r.data_name}</td><td>{r.data_digest[:12]}</td><td>{r.metric}</td>' in html
    assert '<td class="num">12.25</td><td class="num">4096</td>' in html


def test_diff_puts_scores_on_shared_data_side_by_side_with_b_minus_a(evaluated, monkeypatch, tmp_path):
    db, _, rows = evaluated
    runner = wide_runner(monkeypatch)
    a = {r.metric: r.value for r in rows["v1"] if r.data_digest == WIKI}
    b = {r.metric: r.value for r in rows["v2"] if r.data_digest == WIKI}
    deltas = {metric: b[metric] - a[metric] for metric in ("loss", "perplexity")}  # -0.25, -2.75
    as_json = json.loads(invoke(runner, ["diff", "--db", db, "m@1", "m@2", "--json"]))
    assert as_json["evaluations"] == [
        {"data_name": "wiki.txt", "data_digest": WIKI, "metric": m, "a": a[m], "b": b[m], "delta": deltas[m]}
        for m in ("loss", "perplexity")]  # code.txt and arc_easy: only one side was evaluated on them
    text = invoke(runner, ["diff", "--db", db, "m@1", "m@2"])
    assert "evaluations on data both were evaluated on" in text
    table = [c for c in cells(text) if c and c[0] in NAMES.values()]
    assert table == [["wiki.txt", WIKI[:12], "loss", "2.5", "2.25", "-0.25"],
                     ["wiki.txt", WIKI[:12], "perplexity", "12.25", "9.5", "-2.75"]]
    backwards = json.loads(invoke(runner, ["diff", "--db", db, "m@2", "m@1", "--json"]))
    assert [c["delta"] for c in backwards["evaluations"]] == [-d for d in deltas.values()]
    page = tmp_path / "diff.html"
    invoke(runner, ["diff", "--db", db, "m@1", "m@2", "--html", page])
    html = page.read_text(encoding="utf-8")
    assert '<section id="evaluations"><h2>Evaluations</h2>' in html
    assert ('<td class="num">2.5</td><td class="num">2.25</td><td class="num">-0.25</td>' in html
            and '<td class="num">12.25</td><td class="num">9.5</td><td class="num">-2.75</td>' in html)
    assert "code.txt" not in html and "arc_easy" not in html


def test_lineage_shows_each_models_scores_on_the_data_most_of_them_share(evaluated, monkeypatch):
    db, _, rows = evaluated
    runner = wide_runner(monkeypatch)
    text = invoke(runner, ["lineage", "--db", db, "m"])
    shown = [line.lstrip(" │├└─") for line in text.splitlines()]
    # wiki.txt: evaluated for m@2, m@1 and the base; arc_easy is newer, but m@2's alone; e1, e2: never evaluated
    assert shown[:8] == ["m@2  loss=2.25 perplexity=9.5", "base (base)  loss=3", "e1 (expert)", "e2 (expert)",
                         "m@1 (previous version)  loss=2.5 perplexity=12.25", "base (base)  loss=3", "e1 (expert)",
                         "e2 (expert)"]
    assert f"scores on wiki.txt (data {WIKI[:12]})" in text
    tree = json.loads(invoke(runner, ["lineage", "--db", db, "m", "--format", "json"]))
    assert tree["evaluated_on"] == {"data_digest": WIKI, "data_name": "wiki.txt"}
    by_label = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        by_label.setdefault(node["label"], node)
        stack.extend(node["parents"])
    ordered = {key: sorted((r.model_dump() for r in group), key=lambda r: (r["data_name"], r["metric"]))
               for key, group in rows.items()}
    assert by_label["m@2"]["evaluations"] == ordered["v2"] and by_label["m@1"]["evaluations"] == ordered["v1"]
    assert by_label["base"]["evaluations"] == ordered["base"]
    assert "evaluations" not in by_label["e1"] and "evaluations" not in by_label["e2"]


def test_nothing_is_shown_where_nothing_was_evaluated(template, monkeypatch, tmp_path):
    root, db = template
    db = clone_catalog(db, tmp_path / "c.db")
    runner = wide_runner(monkeypatch)
    for args in (["explain", "--db", db, "m@1"], ["diff", "--db", db, "m@1", "m@2"], ["lineage", "--db", db, "m"]):
        text = invoke(runner, args)
        assert "evaluation" not in text and "scores" not in text and "loss" not in text, args
    assert json.loads(invoke(runner, ["explain", "--db", db, "m@1", "--json"]))["evaluations"] == []
    assert json.loads(invoke(runner, ["diff", "--db", db, "m@1", "m@2", "--json"]))["evaluations"] == []
    tree = invoke(runner, ["lineage", "--db", db, "m", "--format", "json"])
    assert "evaluations" not in tree and "evaluated_on" not in tree
    for command, extra in (("explain", ["m@1"]), ("diff", ["m@1", "m@2"])):
        page = tmp_path / f"{command}.html"
        invoke(runner, [command, "--db", db, *extra, "--html", page])
        assert "Evaluations" not in page.read_text(encoding="utf-8") and 'id="evaluations"' not in page.read_text()

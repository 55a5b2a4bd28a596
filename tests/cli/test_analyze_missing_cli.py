"""Experts not yet analysed against the base, through the CLI.

`plan` and `merge` analyse them first by default (one default for both: a
first plan of new experts needs their statistics) and say so in one stderr
line; --no-analyze-missing makes either refuse instead, so that planning
reads no expert byte.
"""

from __future__ import annotations

import json
import re

import pytest

from mergepipe.catalog import Catalog
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.fixtures.cli import run_main
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 2048
ANALYSED_LINE = re.compile(r"^analysed e1, e2 against 'base' in \d+\.\d s \(once: later plans reuse it\)$")
PLAN_ARGS = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5",
             "--budget", "40%", "--no-progress"]


@pytest.fixture(scope="module")
def registered_only(tiny_family, tmp_path_factory):
    """Every tiny model registered, none analysed."""
    path = tmp_path_factory.mktemp("registered") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family))


@pytest.fixture(scope="module")
def analysed_plan(tiny_family, tmp_path_factory):
    """The plan of PLAN_ARGS on a catalog analysed up front (the reference)."""
    path = tmp_path_factory.mktemp("analysed") / "template.db"
    build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])
    with Catalog.open(path) as catalog:
        return Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="40%"))


@pytest.fixture
def db(registered_only, tmp_path):
    return clone_catalog(registered_only, tmp_path / "catalog.db")


def analysed(db, *experts):
    with Catalog.open(db) as catalog:
        return [catalog.stats.is_analyzed(e, "base") for e in experts]


def assert_refused(code, err, db):
    """One `error:` line naming the command that analyses; nothing analysed."""
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "mergepipe analyze" in lines[0] and "--analyze-missing" in lines[0]
    assert "e1 e2`" in lines[0]  # the command to run lists the missing experts
    assert analysed(db, "e1", "e2") == [False, False]


def test_plan_refuses_unanalysed_experts_when_asked(db, capsys):
    code, out, err = run_main(["plan", "--db", db, *PLAN_ARGS, "--save", "--no-analyze-missing"], capsys)
    assert_refused(code, err, db)
    assert "plan id" not in out
    with Catalog.open(db) as catalog:
        assert catalog.plans.list() == []


@pytest.mark.parametrize("flag", [[], ["--analyze-missing"]], ids=["default", "explicit"])
def test_plan_analyses_then_plans(db, capsys, analysed_plan, flag):
    code, out, err = run_main(["plan", "--db", db, *PLAN_ARGS, *flag, "--json"], capsys)
    assert code == 0, err
    assert [ANALYSED_LINE.match(line) is not None for line in err.strip().splitlines()] == [True]
    assert analysed(db, "e1", "e2") == [True, True]
    # the same plan as after a separate `mergepipe analyze`
    assert json.loads(out)["digest"] == analysed_plan.digest
    # analysed once: planning again needs nothing more
    code, _, err = run_main(["plan", "--db", db, *PLAN_ARGS, "--json"], capsys)
    assert code == 0 and err == ""


def test_merge_analyses_missing_experts_by_default(db, capsys, tmp_path, analysed_plan):
    argv = ["merge", "--db", db, *PLAN_ARGS, "--out", tmp_path / "merged", "--model-id", "m", "--quiet"]
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("analysed") and ANALYSED_LINE.match(lines[0]), err
    assert analysed(db, "e1", "e2") == [True, True]
    with Catalog.open(db) as catalog:
        (record,) = catalog.snapshots.list()
    assert record.status == "committed" and record.plan_id == analysed_plan.digest
    # a second merge (another budget: the same plan would give the same snapshot) reuses the analysis
    code, _, err = run_main(["merge", "--db", db, *PLAN_ARGS, "--budget", "60%", "--out", tmp_path / "again",
                             "--model-id", "m2", "--quiet"], capsys)
    assert code == 0 and err == "", err


def test_merge_with_no_analyze_missing_refuses_like_plan(db, capsys, tmp_path):
    parent = tmp_path / "outputs"
    parent.mkdir()
    argv = ["merge", "--db", db, *PLAN_ARGS, "--out", parent / "m", "--model-id", "m", "--no-analyze-missing"]
    code, _, err = run_main(argv, capsys)
    assert_refused(code, err, db)
    assert list(parent.iterdir()) == []
    with Catalog.open(db) as catalog:
        assert catalog.snapshots.list() == [] and not catalog.models.exists("m")

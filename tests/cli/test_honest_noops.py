"""Budgets that read nothing are said out loud; bare fractions are not bytes."""

from __future__ import annotations

from tests.fixtures.cli import run_main
from tests.planner.support import build_catalog


def merge_args(db, out, *extra):
    return ["merge", "--db", str(db), "--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic",
            "--out", str(out), "--model-id", "m", "--no-progress", *extra]


def test_a_budget_that_reads_nothing_warns_even_without_progress_and_strict_refuses(tiny_family, tmp_path, capsys):
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")},
                       base="base", experts=["e1", "e2"])
    code, _, err = run_main(merge_args(db, tmp_path / "strict", "--budget", "0B", "--strict"), capsys)
    assert code != 0 and err.count("\n") == 1 and "reads nothing" in err and "--strict" in err
    assert not (tmp_path / "strict").exists()
    code, _, err = run_main(merge_args(db, tmp_path / "m", "--budget", "0B"), capsys)
    assert code in (0, None) and "warning: the budget (0B) is below the cheapest useful read" in err
    assert (tmp_path / "m").is_dir()


def test_a_bare_fraction_is_refused_with_a_suggestion(tiny_family, tmp_path, capsys):
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    code, _, err = run_main(merge_args(db, tmp_path / "m", "--budget", "0.25"), capsys)
    assert code != 0 and err.count("\n") == 1 and "did you mean 25%?" in err
    assert not (tmp_path / "m").exists()

"""An output path is checked as the filesystem sees it, before anything is written.

A merge never writes inside a registered model or a snapshot (that damages
it: the earlier snapshot would fail ``verify``), however the path is spelled:
through symlinks or ``..``. A ``..`` after a directory that does not exist
is refused rather than normalised away.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.cli import main
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError
from mergepipe.planner.planner import Planner
from mergepipe.txn.publish import resolve_output
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog

BLOCK_BYTES = 4096


@pytest.fixture
def merged(tiny_family, tmp_path) -> dict:
    """A catalog with one committed snapshot at ``tmp/snapshots/first``."""
    db = build_catalog(tmp_path / "c.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])
    out = tmp_path / "snapshots" / "first"
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1"], operator="task_arithmetic"))
        Engine(catalog).execute(plan, out=out, model_id="first")
    return {"db": db, "out": out, "family": tiny_family}


def merge_into(db: Path, out: Path | str) -> None:
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e2"], operator="task_arithmetic"))
        Engine(catalog).execute(plan, out=out, model_id="second")


def assert_untouched(merged: dict) -> None:
    assert verify_snapshot(merged["out"]).ok
    assert not any("staging" in p.name for p in merged["out"].rglob("*"))
    with Catalog.open(merged["db"]) as catalog:
        assert not catalog.models.exists("second")


@pytest.mark.parametrize("spelling", ["inside", "dotdot", "symlink"])
def test_an_output_inside_a_snapshot_is_refused(merged, tmp_path, spelling):
    out = merged["out"]
    if spelling == "inside":
        target = out / "nested"
    elif spelling == "dotdot":
        (tmp_path / "snapshots" / "sibling").mkdir()
        target = tmp_path / "snapshots" / "sibling" / ".." / "first" / "x"
    else:
        link = tmp_path / "shortcut"
        link.symlink_to(out, target_is_directory=True)
        target = link / "x"
    with pytest.raises(ConfigError, match=f"is inside model 'first' \\({out}\\)"):
        merge_into(merged["db"], target)
    assert_untouched(merged)


def test_an_output_inside_a_registered_model_is_refused(merged):
    base_dir = merged["family"]["base"]
    before = sorted(p.name for p in base_dir.iterdir())
    with pytest.raises(ConfigError, match=f"is inside model 'base' \\({base_dir.resolve()}\\)"):
        merge_into(merged["db"], base_dir / "merged-here")
    assert sorted(p.name for p in base_dir.iterdir()) == before


def test_the_cli_refuses_it_in_one_line(merged, tmp_path, capsys):
    code = 0
    try:
        main(["merge", "--db", str(merged["db"]), "--base", "base", "--experts", "e2", "--out",
              str(merged["out"] / "sub"), "--model-id", "second", "--no-progress"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: output path ")
    assert_untouched(merged)


def test_dotdot_after_a_missing_directory_is_refused(tmp_path):
    (tmp_path / "c5").mkdir()
    with pytest.raises(ConfigError, match="'..' follows .*c5/sub, which does not exist"):
        resolve_output(tmp_path / "c5" / "sub" / ".." / "x")


def test_resolve_output_follows_links_and_real_parents(tmp_path):
    real = tmp_path / "real" / "deep"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    assert resolve_output(tmp_path / "link" / "out") == real / "out"
    # '..' steps up from the real directory, as the kernel does, not from the link's parent
    assert resolve_output(tmp_path / "link" / ".." / "out") == tmp_path / "real" / "out"
    assert resolve_output(tmp_path / "a" / "b") == tmp_path / "a" / "b"  # a missing tail is kept as given


def test_relative_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_output("out") == Path(os.path.realpath(tmp_path)) / "out"

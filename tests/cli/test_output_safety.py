"""Every command that writes a file or a folder refuses paths inside registered models and snapshots, and
refuses to overwrite an existing file unless --force: `explain --html`, `diff --html`, `export-delta
--out`, `merge|execute --json-summary`. Checked as a user would type it; what was there stays byte for byte."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def merged(tiny_family, tmp_path, monkeypatch):
    """A catalog with base, e1, e2 and two versions of merged model `m` at ./v1 and ./v2."""
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    runner = wide_runner(monkeypatch)
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic", "--no-progress"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "v1", "--model-id", "m"])
    invoke(runner, ["merge", *args, "--seed", "3", "--budget", "50%", "--out", tmp_path / "v2", "--model-id", "m"])
    return runner, db


def _refused(capsys, argv: list, *words: str) -> None:
    code, _, err = run_main([str(a) for a in argv], capsys)
    assert code not in (0, None) and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def _protected(tiny_family, tmp_path) -> list[Path]:
    """Weight files of a registered checkpoint and of a committed snapshot."""
    return [Path(tiny_family["e1"]) / "model.safetensors", tmp_path / "v1" / "model.safetensors"]


@pytest.mark.parametrize("command", ["explain", "diff"])
def test_html_reports_never_overwrite_weights(merged, tiny_family, tmp_path, capsys, command):
    _, db = merged
    target = ["m@1"] if command == "explain" else ["m@1", "m@2"]
    for weights in _protected(tiny_family, tmp_path):
        before = digest(weights)
        for force in ([], ["--force"]):
            _refused(capsys, [command, "--db", db, *target, "--html", weights, *force], "inside", "--html")
        assert digest(weights) == before


@pytest.mark.parametrize("command", ["explain", "diff"])
def test_an_existing_report_is_replaced_only_with_force(merged, tmp_path, capsys, command):
    runner, db = merged
    target = ["m@1"] if command == "explain" else ["m@1", "m@2"]
    page = tmp_path / "report.html"
    page.write_text("keep me")
    _refused(capsys, [command, "--db", db, *target, "--html", page], "already exists", "--force")
    assert page.read_text() == "keep me"
    invoke(runner, [command, "--db", db, *target, "--html", page, "--force"])
    assert page.read_text().startswith("<!DOCTYPE html>")
    (tmp_path / "folder.html").mkdir()
    code, _, err = run_main([command, "--db", str(db), *target, "--html", str(tmp_path / "folder.html"), "--force"],
                            capsys)
    assert code == 2 and "is a directory" in err and "Traceback" not in err


def test_export_delta_never_writes_into_a_model_or_snapshot(merged, tiny_family, tmp_path, capsys):
    _, db = merged
    for inside in (Path(tiny_family["e1"]) / "delta", tmp_path / "v1" / "delta"):
        before = sorted(p.name for p in inside.parent.iterdir())
        _refused(capsys, ["export-delta", "--db", db, "--model", "e2", "--out", inside, "--no-progress"], "inside")
        assert sorted(p.name for p in inside.parent.iterdir()) == before


def test_a_json_summary_is_refused_inside_models_and_over_a_file_without_force(merged, tiny_family, tmp_path, capsys):
    runner, db = merged
    args = ["--db", db, "--base", "base", "--experts", "e1", "--operator", "task_arithmetic", "--no-progress"]
    weights = Path(tiny_family["e1"]) / "model.safetensors"
    before = digest(weights)
    _refused(capsys, ["merge", *args, "--out", tmp_path / "a", "--model-id", "x", "--json-summary", weights,
                      "--force"], "inside", "--json-summary")
    assert digest(weights) == before and not (tmp_path / "a").exists()
    summary = tmp_path / "summary.json"
    summary.write_text("{}")
    _refused(capsys, ["merge", *args, "--out", tmp_path / "b", "--model-id", "x", "--json-summary", summary],
             "already exists", "--force")
    assert summary.read_text() == "{}" and not (tmp_path / "b").exists()  # refused before any work
    invoke(runner, ["merge", *args, "--out", tmp_path / "c", "--model-id", "x", "--json-summary", summary, "--force"])
    assert '"snapshot_id"' in summary.read_text()


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
def test_no_output_overwrites_the_catalog_whatever_force_says(merged, tmp_path, capsys, suffix):
    """`merge --json-summary CATALOG --force` left the catalog malformed, and every later command failed."""
    runner, db = merged
    target = Path(f"{db}{suffix}")
    args = ["--db", db, "--base", "base", "--experts", "e1", "--operator", "task_arithmetic", "--no-progress"]
    _refused(capsys, ["merge", *args, "--out", tmp_path / "a", "--model-id", "x", "--json-summary", target, "--force"],
             "is the catalog", "--json-summary")
    _refused(capsys, ["explain", "--db", db, "m@1", "--html", target, "--force"], "is the catalog", "--html")
    assert not (tmp_path / "a").exists()
    assert "m@2" in invoke(runner, ["snapshots", "--db", db])  # the catalog reads as before


def test_a_catalog_is_never_written_inside_a_snapshot(merged, tiny_family, tmp_path, capsys):
    """`init-db --db SNAP/cat.db` and `catalog export --to SNAP/...` wrote a file the snapshot's `verify` then
    called damage; a snapshot is known by its manifest even to a catalog that has no record of it."""
    runner, db = merged
    snapshot = tmp_path / "v1"
    before = sorted(p.name for p in snapshot.iterdir())
    _refused(capsys, ["init-db", "--db", snapshot / "cat.db"], "inside snapshot", "--db")
    _refused(capsys, ["register", "--db", snapshot / "cat.db", "--model-id", "b", "--uri", tiny_family["base"]],
             "inside snapshot", "--db")
    _refused(capsys, ["catalog", "export", "--db", db, "--to", snapshot / "copy.db"], "is inside model", "--to")
    assert sorted(p.name for p in snapshot.iterdir()) == before
    assert "OK " in invoke(runner, ["verify", "--db", db, snapshot])

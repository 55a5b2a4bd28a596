"""Each command's Python equivalent (``from mergepipe import ...``) does what the command does: the same
plan digests, snapshot ids, manifest hashes and views, in two catalogs built side by side."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

import mergepipe
from mergepipe import MergeRequest
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, wide_runner


@pytest.fixture
def both(tiny_family, tmp_path, monkeypatch):
    """A CLI runner, and two empty folders: one for the command line's catalog and outputs, one for Python's."""
    cli_dir, py_dir = tmp_path / "cli", tmp_path / "py"
    cli_dir.mkdir()
    py_dir.mkdir()
    return wide_runner(monkeypatch), cli_dir, py_dir


def test_register_analyze_plan_merge_execute(tiny_family, both):
    runner, cli_dir, py_dir = both
    db_c, db_p = cli_dir / "c.db", py_dir / "c.db"
    invoke(runner, ["init-db", "--db", db_c, "--block-bytes", "2KiB"])
    assert mergepipe.init_db(db_p, "2KiB").block_bytes == 2048
    for name in ("base", "e1", "e2"):
        invoke(runner, ["register", "--db", db_c, "--model-id", name, "--uri", tiny_family[name]])
        assert mergepipe.register(db_p, name, tiny_family[name]).status == "registered"
    invoke(runner, ["analyze", "--db", db_c, "--base", "base", "--no-progress"])
    done = mergepipe.analyze(db_p, base="base")
    assert done.report.analyzed == ("e1", "e2")

    args = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5", "--budget", "40%"]
    request = MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5},
                           budget="40%")
    planned = json.loads(invoke(runner, ["plan", "--db", db_c, *args, "--json", "--save"]))
    plan = mergepipe.plan(request, db_p, save=True)
    assert plan.digest == planned["digest"]

    invoke(runner, ["merge", "--db", db_c, *args, "--out", cli_dir / "m", "--model-id", "m", "--no-progress",
                    "--json-summary", cli_dir / "s.json"])
    merged = mergepipe.merge(MergeRequest(**request.model_dump(exclude={"budget", "model_id"}), budget="40%", model_id="m"),
                             db_p, py_dir / "m")
    summary = json.loads((cli_dir / "s.json").read_text())
    assert (merged.snapshot_id, merged.manifest.manifest_hash) == (summary["snapshot_id"], summary["manifest_hash"])
    assert (py_dir / "m" / "model.safetensors").read_bytes() == (cli_dir / "m" / "model.safetensors").read_bytes()

    invoke(runner, ["execute", "--db", db_c, "--plan", plan.digest[:12], "--out", cli_dir / "again",
                    "--no-progress", "--json-summary", cli_dir / "again.json"])
    again = mergepipe.execute(plan.digest[:12], db_p, py_dir / "again")
    assert again.rematerialised and again.snapshot_id == merged.snapshot_id
    assert json.loads((cli_dir / "again.json").read_text())["snapshot_id"] == again.snapshot_id


def test_the_views_and_gc(tiny_family, both):
    runner, cli_dir, py_dir = both
    for folder in (cli_dir, py_dir):  # the same catalog, made once and copied: views are compared on equal ground
        db = folder / "c.db"
        if folder == cli_dir:
            for name in ("base", "e1", "e2"):
                mergepipe.register(db, name, tiny_family[name])
            for budget, seed in (("100%", 0), ("50%", 3)):
                mergepipe.merge(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic",
                                             budget=budget, seed=seed, model_id="m"), db, folder / f"m{seed}")
        else:
            shutil.copy(cli_dir / "c.db", db)
    db_c, db_p = cli_dir / "c.db", py_dir / "c.db"

    explained = json.loads(invoke(runner, ["explain", "--db", db_c, "m@1", "--json"]))
    assert mergepipe.explain(db_p, "m@1").to_json() == explained
    differ = json.loads(invoke(runner, ["diff", "--db", db_c, "m@1", "m@2", "--json"]))
    assert mergepipe.diff(db_p, "m@1", "m@2").to_json() == differ
    tree = json.loads(invoke(runner, ["lineage", "--db", db_c, "m", "--format", "json"]))
    assert mergepipe.lineage(db_p, "m") == tree
    checked = json.loads(invoke(runner, ["verify", "--db", db_c, "m@2", "--json"]))
    report = mergepipe.verify("m@2", db_p)
    assert (report.ok, report.files_checked, report.manifest.manifest_hash) == \
        (checked["ok"], checked["files_checked"], checked["manifest_hash"])
    text = invoke(runner, ["gc", "--db", db_c])
    collected = mergepipe.gc(db_p)
    assert f"removed {len(collected.removed_dirs)} staging directories" in text


def test_integrate(tiny_family, both, tmp_path):
    runner, cli_dir, py_dir = both
    for folder in (cli_dir, py_dir):
        shutil.copytree(tiny_family["e1"], folder / "e1")
        (folder / "recipe.yml").write_text(yaml.safe_dump({
            "base": str(tiny_family["base"]), "experts": {"e1": "e1", "e2": str(tiny_family["e2"])},
            "operator": "ties", "params": {"density": 0.5}, "output": {"root": "deploy", "model_id": "m", "keep": 1}}))
    invoke(runner, ["integrate", "--db", cli_dir / "c.db", cli_dir / "recipe.yml", "--no-progress"])
    first = mergepipe.integrate(py_dir / "recipe.yml", py_dir / "c.db")
    assert first.published is not None
    for folder in (cli_dir, py_dir):  # e1 retrained in place, in its layer 1
        new = make_expert(folder / "e1", tmp_path / f"new-{folder.name}", seed=9, touch=lambda n: ".layers.1." in n)
        shutil.copy(new / "model.safetensors", folder / "e1" / "model.safetensors")
    text = invoke(runner, ["integrate", "--db", cli_dir / "c.db", cli_dir / "recipe.yml", "--no-progress"])
    second = mergepipe.integrate(py_dir / "recipe.yml", py_dir / "c.db")
    snapshot_id, out, _ = second.published
    assert f"({snapshot_id})" in text and second.plan.reuse is not None and second.removed == [first.published[1]]
    assert (out / "model.safetensors").read_bytes() == \
        (cli_dir / "deploy" / "m-v2" / "model.safetensors").read_bytes()
    assert [p.name for p in Path(cli_dir / "deploy").iterdir()] == ["m-v2"]

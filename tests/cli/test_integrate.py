"""`mergepipe integrate`: one iteration of continuous integration per run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from mergepipe.catalog import Catalog
from mergepipe.catalog.snapshots import host_key
from mergepipe.engine.engine import Engine
from mergepipe.manifest.manifest import read_manifest
from mergepipe.planner.planner import Planner
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner


@pytest.fixture
def pipeline(tiny_family, tmp_path):
    """Copies of the experts (so a test can retrain one in place) and a recipe keeping one version."""
    for name in ("e1", "e2", "e3"):
        shutil.copytree(tiny_family[name], tmp_path / "experts" / name)
    recipe = {
        "base": str(tiny_family["base"]),
        "experts": {name: f"experts/{name}" for name in ("e1", "e2", "e3")},
        "operator": "ties",
        "params": {"density": 0.5},
        "output": {"root": "deploy", "model_id": "merged", "keep": 1},
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_runs_publish_only_when_something_changed_and_merge_incrementally(pipeline, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    db, deploy = tmp_path / "c.db", tmp_path / "deploy"
    first = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    assert "published merged" in first and verify_snapshot(deploy / "merged-v1").ok

    again = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    assert "nothing changed since merged" in again and "nothing published" in again
    assert sorted(p.name for p in deploy.iterdir()) == ["merged-v1"]

    # e1 is retrained in place, in its layer 1 only
    retrained = make_expert(tmp_path / "experts" / "e1", tmp_path / "e1-new", seed=9,
                            touch=lambda n: ".layers.1." in n)
    shutil.copy(retrained / "model.safetensors", tmp_path / "experts" / "e1" / "model.safetensors")
    third = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    assert "new version" in third and "e1@2" in third and "published merged@2" in third
    assert "reused" in third and "unchanged" in third
    assert sorted(p.name for p in deploy.iterdir()) == ["merged-v2"]  # keep: 1
    assert verify_snapshot(deploy / "merged-v2").ok

    with Catalog.open(db) as catalog:  # the same merge from scratch gives the same bytes
        assert [v.label for v in catalog.models.versions("merged")] == ["merged@1", "merged@2"]
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2", "e3"], operator="ties", params={"density": 0.5}))
        Engine(catalog).execute(plan, out=tmp_path / "scratch", model_id="scratch")
    assert (tmp_path / "scratch" / "model.safetensors").read_bytes() == \
        (deploy / "merged-v2" / "model.safetensors").read_bytes()


def test_a_malformed_recipe_is_one_line_and_writes_nothing(pipeline, tmp_path, capsys):
    recipe = yaml.safe_load(pipeline.read_text())
    recipe["budgett"] = "10%"
    pipeline.write_text(yaml.safe_dump(recipe))
    code, _, err = run_main(["integrate", "--db", str(tmp_path / "c.db"), str(pipeline)], capsys)
    assert code == 2 and err.count("\n") == 1 and "unknown key 'budgett'" in err
    assert not (tmp_path / "c.db").exists() and not (tmp_path / "deploy").exists()


def test_integrate_merges_as_merge_does_predicts_its_seconds_and_times_itself(pipeline, tmp_path, monkeypatch):
    """--workers/--executor/--max-memory/--device reach the engine (two worker threads give the same bytes as
    the one of a plain run); the plan predicts the merge's seconds from this catalog's timings (the analysis it
    ran, the kernel it probed), and the merge adds its row of timings, as `merge` does."""
    runner = wide_runner(monkeypatch)
    plain_db, db = tmp_path / "plain.db", tmp_path / "c.db"
    invoke(runner, ["integrate", "--db", plain_db, pipeline, "--no-progress"])
    plain = (tmp_path / "deploy" / "merged-v1" / "model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "deploy")
    text = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress", "--workers", "2",
                           "--executor", "local", "--max-memory", "64MiB", "--device", "cpu"])
    assert "published merged" in text and "predicted" in text and "prior only" in text
    assert (tmp_path / "deploy" / "merged-v1" / "model.safetensors").read_bytes() == plain
    with Catalog.open(db) as catalog:
        snapshot = catalog.snapshots.of_model(catalog.models.latest("merged").id)
        manifest = read_manifest(Path(snapshot.out_path))[0]
        merges = catalog.timings.merges(host_key(), "cpu", "ties", 10)
        assert catalog.timings.read_rate(host_key()) is not None  # the analysis it ran
        assert set(catalog.timings.kernel_seconds(host_key(), "cpu")) == {"ties"}  # the kernel it merged with
    estimated = manifest.cost.estimated.seconds
    assert estimated and estimated["total"] > 0 and estimated["merges"] == 0
    assert [(m.expert_bytes, m.output_bytes) for m in merges] == [(manifest.cost.realized.expert_bytes,
                                                                   manifest.cost.realized.output_bytes)]


def test_integrate_refuses_bad_execution_options_in_one_line(pipeline, tmp_path, capsys):
    code, _, err = run_main(["integrate", "--db", str(tmp_path / "c.db"), str(pipeline), "--ray-address", "auto"],
                            capsys)
    assert code != 0 and err.strip() == "error: --ray-address needs --executor ray"

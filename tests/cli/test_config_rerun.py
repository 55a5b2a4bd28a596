"""A snapshot's ``mergepipe_config.yml`` rerun in the catalog that made it is the same merge: the budget as
it was written (``60%``, not the bytes it came to: the plan's digest holds the text), the output dtype as
it was, so the same plan and the same snapshot (re-materialised), never a new version with the same weights.
It says ``dtype: float32`` (what MergePipe computes in) and the output dtype apart: ``out_dtype``, or
``mergepipe: {out_dtype: base}`` for a merge that kept the base's dtypes. ``test_mergekit_outputs.py``
runs mergekit on it."""

from __future__ import annotations

import json

import pytest
import yaml

from mergepipe.catalog import Catalog
from tests.fixtures.cli import invoke, wide_runner


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _snapshots(db) -> list[tuple[str, str]]:
    with Catalog.open(db) as catalog:
        return sorted((s.id, s.model_id) for s in catalog.snapshots.list())


def _rerun(runner, db, out, again) -> str:
    return invoke(runner, ["merge", "--db", db, "--config", out / "mergepipe_config.yml", "--out", again,
                           "--no-progress"])


def test_a_mergekit_config_s_written_config_reruns_to_the_same_snapshot(tiny_family, tmp_path, runner):
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump({
        "merge_method": "ties",
        "base_model": str(tiny_family["base"]),
        "models": [{"model": str(tiny_family["e1"]), "parameters": {"weight": [0, 0.3, 0.7, 1], "density": 0.5}},
                   {"model": str(tiny_family["e2"]), "parameters": {"weight": 0.5, "density": 0.7}}],
        "dtype": "bfloat16",
        "mergepipe": {"budget": "60%", "model_id": "m"},
    }))
    db, out = tmp_path / "c.db", tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--config", config, "--out", out, "--no-progress"])
    written = yaml.safe_load((out / "mergepipe_config.yml").read_text())
    assert (written["dtype"], written["out_dtype"]) == ("float32", "bfloat16")  # computed in f32, written in bf16
    assert written["mergepipe"]["budget"] == "60%" and "out_dtype" not in written["mergepipe"]
    before = _snapshots(db)

    text = _rerun(runner, db, out, tmp_path / "again")
    manifest = json.loads((out / "manifest.json").read_text())
    assert f"re-materialised snapshot {manifest['snapshot_id']}" in text
    assert _snapshots(db) == before  # the same snapshot: no new version of 'm'
    assert json.loads((tmp_path / "again" / "manifest.json").read_text())["manifest_hash"] == manifest["manifest_hash"]


def test_a_merge_that_kept_the_base_s_dtypes_says_so_and_reruns_to_the_same_snapshot(tiny_family, tmp_path, runner):
    db, out = tmp_path / "c.db", tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--base", tiny_family["base"], "--experts", tiny_family["e1"],
                    tiny_family["e2"], "--operator", "task_arithmetic", "--budget", "30%", "--out", out,
                    "--model-id", "m", "--no-progress"])
    written = yaml.safe_load((out / "mergepipe_config.yml").read_text())
    assert written["dtype"] == "float32" and "out_dtype" not in written
    assert written["mergepipe"]["out_dtype"] == "base" and written["mergepipe"]["budget"] == "30%"
    before = _snapshots(db)
    assert "re-materialised" in _rerun(runner, db, out, tmp_path / "again")
    assert _snapshots(db) == before
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()

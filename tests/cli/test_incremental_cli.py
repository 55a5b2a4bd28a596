"""Incremental merges through the CLI: merge --from, plan --from, explain's reused / recomputed split."""

from __future__ import annotations

import json
import re

from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog


def test_merge_from_reuses_and_explain_splits_reused_and_recomputed(tiny_family, tmp_path, monkeypatch, capsys):
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=5, touch=lambda n: ".layers.0." in n)
    runner = wide_runner(monkeypatch)
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "v1", "--model-id", "merged", "--no-progress"])
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])

    planned = invoke(runner, ["plan", *args, "--from", "merged", "--analyze-missing", "--no-progress"])
    assert "reused" in planned and "of 'merged'" in planned
    invoke(runner, ["merge", *args, "--from", "merged", "--out", tmp_path / "v2", "--model-id", "merged",
                    "--no-progress"])
    invoke(runner, ["merge", *args, "--out", tmp_path / "scratch", "--model-id", "scratch", "--no-progress"])
    assert (tmp_path / "v2" / "model.safetensors").read_bytes() == \
        (tmp_path / "scratch" / "model.safetensors").read_bytes()

    explained = invoke(runner, ["explain", "--db", db, "merged"])
    assert "incremental" in explained and "recomputed" in explained
    data = json.loads(invoke(runner, ["explain", "--db", db, "merged", "--json"]))
    assert data["reused_from"] == "merged"
    for tensor in data["tensors"]:  # layer 0 changed: recomputed; everything else reused whole
        assert (tensor["reused_bytes"] == 0) == (".layers.0." in tensor["tensor"]), tensor["tensor"]
    saved = {e["expert"]: e["reused_bytes"] for e in data["experts"]}
    assert sum(saved.values()) == sum(t["reused_bytes"] for t in data["tensors"]) > 0
    for e in data["experts"]:  # what was not reused was read, exactly
        assert e["realized_bytes"] == e["planned_bytes"] - e["reused_bytes"]

    code, _, err = run_main(["merge", *[str(a) for a in args], "--from", "e2", "--out", str(tmp_path / "v3"),
                             "--model-id", "merged", "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1 and "not a merged model" in err, err
    assert not (tmp_path / "v3").exists()


def test_delta_update_through_the_cli(tiny_family, tmp_path, monkeypatch):
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=5, touch=lambda n: ".layers.0." in n)
    runner = wide_runner(monkeypatch)
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "v1", "--model-id", "merged", "--no-progress"])
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    merged = invoke(runner, ["merge", *args, "--from", "merged", "--delta-update", "--out", tmp_path / "v2",
                             "--model-id", "merged", "--no-progress", "--json-summary", tmp_path / "s.json"])
    assert "published" in merged
    summary = json.loads((tmp_path / "s.json").read_text())
    # the bound measured after the merge: below the plan's, and what the table says
    assert 0 < summary["update_bound"] < summary["error_bound"]
    assert re.search(rf"delta-update bound +│ {summary['update_bound']:.6g} measured after the merge", merged)
    explained = invoke(runner, ["explain", "--db", db, "merged"])
    assert "delta updates" in explained and "not bit-identical" in explained and "updated)" in explained

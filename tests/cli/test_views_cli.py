"""lineage --format text|dot|json and verify --json."""

from __future__ import annotations

import json

from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog


def test_lineage_formats_and_verify_json(tiny_family, tmp_path, monkeypatch, capsys):
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    runner = wide_runner(monkeypatch)
    for weights, out in ((["1", "1"], "v1"), (["0.5", "1"], "v2")):
        invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator",
                        "task_arithmetic", "--weights", *weights, "--out", tmp_path / out, "--model-id", "m",
                        "--no-progress"])
    tree = json.loads(invoke(runner, ["lineage", "--db", db, "m", "--format", "json"]))
    assert (tree["id"], tree["label"]) == ("m@2", "m@2")
    assert [(p["label"], p["role"]) for p in tree["parents"]] == [
        ("base", "base"), ("e1", "expert"), ("e2", "expert"), ("m@1", "previous version")]
    assert [p["label"] for p in tree["parents"][3]["parents"]] == ["base", "e1", "e2"]
    dot = invoke(runner, ["lineage", "--db", db, "m", "--format", "dot"])
    assert dot.startswith("digraph lineage {") and '"m@1" -> "m@2" [label="previous version"];' in dot
    assert dot.count('"e1" -> "m@1"') == 1 and dot.count('"e1" -> "m@2"') == 1

    report = json.loads(invoke(runner, ["verify", str(tmp_path / "v2"), "--json"]))
    assert report["ok"] and report["problems"] == [] and report["files_checked"] >= 2
    weights_file = tmp_path / "v2" / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1
    weights_file.write_bytes(bytes(data))
    code, out, err = run_main(["verify", str(tmp_path / "v2"), "--json"], capsys)
    assert code != 0 and not json.loads(out)["ok"] and err.count("\n") == 1

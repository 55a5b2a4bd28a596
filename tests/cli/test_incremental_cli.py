"""Incremental merges through the CLI: merge --from, plan --from, explain's reused / recomputed split and
how a snapshot's output bytes got there."""

from __future__ import annotations

import html
import json
import os
import re

from mergepipe.sizes import format_bytes
from mergepipe.storage import writer as linking
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog, raw_layout


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


def test_explain_says_how_an_incremental_snapshots_output_got_there(tiny_family, tmp_path, monkeypatch):
    """Sharded output, e1 retrained in layer 0 only: what explain reports is checked against the files on
    disk. Copied by the kernel (no reflink here: forced, whatever the disk): the v2 shards without a layer-0
    tensor, whole, and the other shards' tensors outside layer 0 (reused runs, copied on the writer thread);
    written: the rest of those shards (headers, layer 0)."""
    monkeypatch.setattr(linking, "_clone", lambda source_fd, target_fd: False)
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=5, touch=lambda n: ".layers.0." in n)
    runner = wide_runner(monkeypatch)
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5",
            "--out-shard-size", "40KB", "--no-progress"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "v1", "--model-id", "merged"])
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    merged = invoke(runner, ["merge", *args, "--from", "merged", "--out", tmp_path / "v2", "--model-id", "merged",
                             "--analyze-missing", "--json-summary", tmp_path / "v2.json"])
    summary = " ".join(merged.replace("│", " ").split())  # the merge's own summary, its wrapped cells read whole
    assert "(including any kernel copies of reused blocks) ran alongside" in summary
    v1_id = json.loads((tmp_path / "v1" / "manifest.json").read_text())["snapshot_id"]
    v2_id = json.loads((tmp_path / "v2" / "manifest.json").read_text())["snapshot_id"]

    shards = sorted({t.file.name for t in raw_layout(tmp_path / "v2").values()})
    sizes = {name: os.stat(tmp_path / "v2" / name).st_size for name in shards}
    layer0 = [t for t in raw_layout(tmp_path / "v2").values() if ".layers.0." in t.name]
    whole = [n for n in shards if not any(t.file.name == n for t in layer0)]
    assert whole and set(shards) - set(whole)
    assert not any(os.path.samestat(os.stat(tmp_path / "v1" / n), os.stat(tmp_path / "v2" / n)) for n in shards)
    copied = sum(t.nbytes for t in raw_layout(tmp_path / "v2").values()
                 if t.file.name not in whole and t not in layer0)
    written = sum(sizes[n] for n in shards if n not in whole) - copied
    # what was written: the made shards' headers and their layer-0 tensors, nothing else
    assert written == sum(sizes[n] - sum(t.nbytes for t in raw_layout(tmp_path / "v2").values() if t.file.name == n)
                          for n in shards if n not in whole) + sum(t.nbytes for t in layer0)
    copied += sum(sizes[n] for n in whole)
    expected = {"linked": 0, "cloned": 0, "copied": copied, "written": written}
    assert sum(expected.values()) == sum(sizes.values())

    data = json.loads(invoke(runner, ["explain", "--db", db, v2_id[:16], "--json"]))
    assert data["output_bytes_by_method"] == expected
    assert data["reused_from"] == "merged" and data["reused_snapshot"] == v1_id
    line = (f"{format_bytes(sum(sizes.values()))}: 0 B reflinked and {format_bytes(copied)} copied by the kernel "
            f"from snapshot {v1_id}, each checked against its recorded hash, {format_bytes(written)} written")
    text = invoke(runner, ["explain", "--db", db, v2_id[:16]])
    rows = text.splitlines()
    at = next(i for i, row in enumerate(rows) if re.match(r"│ output +│ ", row))
    assert line in rows[at] and "incremental" in rows[at - 1]  # right after the reuse line
    assert "writing " in text and "(including any kernel copies of reused blocks) ran alongside" in text
    page = tmp_path / "v2.html"
    invoke(runner, ["explain", "--db", db, v2_id[:16], "--html", page])
    shown = html.unescape(page.read_text())
    assert line in shown and "(write includes any kernel copies of reused blocks)" in shown

    # nothing of it for a snapshot merged from scratch, nor for a plan (no manifest: nothing realized)
    plan_id = json.loads((tmp_path / "v2.json").read_text())["plan_id"]
    for target in (v1_id[:16], plan_id[:16]):
        data = json.loads(invoke(runner, ["explain", "--db", db, target, "--json"]))
        assert data["output_bytes_by_method"] == {}, target
        text = invoke(runner, ["explain", "--db", db, target])
        assert not re.search(r"│ output +│", text) and "kernel copies" not in text, target
    assert "incremental" in text  # the plan still says what it reuses

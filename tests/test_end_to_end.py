"""The whole loop as a person runs it: the seed's script, then init-db ->
register -> analyze -> plan --save -> execute -> verify -> explain ->
lineage, and a merged snapshot used as the base of a later merge."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from mergepipe.catalog import Catalog
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import invoke, wide_runner
from tests.planner.support import REPO, frobenius, load_tensors, subprocess_env


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def test_merge_fast_io_budget_script(tiny_family, tmp_path):
    db, out, summary = tmp_path / "catalog.db", tmp_path / "merged", tmp_path / "summary.json"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "merge_fast_io_budget.sh"), "--db", str(db),
         "--base", str(tiny_family["base"]), "--experts", str(tiny_family["e1"]), str(tiny_family["e2"]),
         "--out", str(out), "--model-id", "fast", "--budget", "25%", "--no-progress",
         "--json-summary", str(summary)],
        capture_output=True, text=True, env=subprocess_env(), timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # a fresh catalog: the script analyses the experts first and says so once
    analysed = [line for line in proc.stderr.splitlines() if line.startswith("analysed")]
    assert len(analysed) == 1 and analysed[0].startswith("analysed e1, e2 against 'base' in "), proc.stderr[-3000:]
    data = json.loads(summary.read_text())
    assert data["snapshot_id"] in proc.stdout.replace("\n", "")
    assert data["realized"]["expert_bytes"] <= data["planned"]["expert_bytes"] <= data["budget_bytes"]
    assert data["budget_bytes"] == int(0.25 * data["planned"]["full_expert_bytes"])
    assert verify_snapshot(out).ok
    with Catalog.open(db) as catalog:
        assert catalog.models.parents("fast") == [("base", "base"), ("e1", "expert"), ("e2", "expert")]


def test_the_whole_loop(tiny_family, runner, tmp_path):
    db = tmp_path / "catalog.db"
    invoke(runner, ["init-db", "--db", db, "--block-bytes", "4KiB"])
    for name in ("base", "e1", "e2", "e3"):
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", tiny_family[name]])
    invoke(runner, ["analyze", "--db", db, "--base", "base", "e1", "e2", "e3", "--no-progress"])
    experts = ["--experts", "e1", "e2", "e3"]
    ties = ["--operator", "ties", "--density", "0.5", "--no-progress"]

    output = invoke(runner, ["plan", "--db", db, "--base", "base", *experts, *ties, "--budget", "25%", "--save"])
    plan_id = re.search(r"plan id: ([0-9a-f]{64})", output).group(1)
    invoke(runner, ["execute", "--db", db, "--plan", plan_id, "--out", tmp_path / "m25", "--model-id", "m25",
                    "--no-progress"])
    invoke(runner, ["merge", "--db", db, "--base", "base", *experts, *ties, "--out", tmp_path / "full",
                    "--model-id", "full"])

    with Catalog.open(db) as catalog:
        records = {s.model_id: s for s in catalog.snapshots.list()}
    assert {m: r.status for m, r in records.items()} == {"m25": "committed", "full": "committed"}
    for model_id, record in records.items():
        assert "OK" in invoke(runner, ["verify", "--db", db, record.id])

    # the budgeted merge read at most a quarter of the changed expert bytes and is close to the full merge
    explained = json.loads(invoke(runner, ["explain", "--db", db, records["m25"].id, "--json"]))
    assert explained["realized_expert_bytes"] <= 0.25 * explained["full_expert_bytes"]
    budgeted, full = load_tensors(tmp_path / "m25"), load_tensors(tmp_path / "full")
    base = load_tensors(tiny_family["base"])
    assert 0 < frobenius(budgeted, full) < frobenius(base, full)

    # a snapshot is a model: it can be the base of the next merge
    invoke(runner, ["merge", "--db", db, "--base", "full", "--experts", "e3", "--operator", "task_arithmetic",
                    "--weights", "0.5", "--out", tmp_path / "next", "--model-id", "next", "--no-progress"])
    tree = invoke(runner, ["lineage", "--db", db, "next"])
    assert tree.splitlines()[0].strip() == "next"
    for needle in ("full (base)", "e3 (expert)", "e1 (expert)", "e2 (expert)"):
        assert needle in tree
    nxt, full = load_tensors(tmp_path / "next"), load_tensors(tmp_path / "full")
    e3 = load_tensors(tiny_family["e3"])
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = (full[name].float() + (e3[name].float() - full[name].float()) * 0.5).to(torch.bfloat16)
    assert torch.equal(nxt[name], expected)
    models = json.loads(invoke(runner, ["models", "--db", db, "--json"]))
    assert {m["id"]: m["kind"] for m in models}["next"] == "snapshot"


def test_the_gpu_check_script_runs_on_the_cpu(tmp_path, capsys):
    """scripts/gpu_check.py (run on a GPU by scripts/gpu-check.sh, where CI has none) kept in step with the
    package: every case planned and executed twice, here both on the CPU, whose outputs must agree bit for bit."""
    from scripts.gpu_check import main

    assert main(tmp_path / "check", ("cpu", "cpu")) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.split()[1:2] in (["100%"], ["30%"])]
    assert len(rows) == 24 and all(r.endswith(("bit-identical", "max relative diff 0.00e+00")) for r in rows)

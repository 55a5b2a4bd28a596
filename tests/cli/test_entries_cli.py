"""``analyze --store-deltas`` and ``--policy entries`` through the CLI."""

from __future__ import annotations

import json

import pytest

from mergepipe.catalog import Catalog
from mergepipe.spec.plan import Plan
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog


@pytest.fixture
def db(tiny_family, tmp_path):
    return build_catalog(tmp_path / "c.db", 2048, dict(tiny_family), base="base", experts=["e1", "e2"])


def test_store_deltas_then_an_entries_merge(db, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    out = invoke(runner, ["analyze", "--db", db, "--base", "base", "--store-deltas", tmp_path / "stores",
                          "--no-progress", "e1", "e2"])
    assert "delta store of 'e1':" in out and "delta store of 'e2':" in out
    again = invoke(runner, ["analyze", "--db", db, "--base", "base", "--store-deltas", tmp_path / "stores",
                            "--no-progress", "e1", "e2"])
    assert "every expert already has one" in again
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties",
                    "--density", "0.5", "--budget", "20%", "--policy", "entries", "--out", tmp_path / "m",
                    "--model-id", "m", "--no-progress"])
    with Catalog.open(db) as catalog:
        snapshot = next(s for s in catalog.snapshots.list() if s.model_id == "m")
        plan = Plan.from_json(catalog.plans.get(snapshot.plan_id))
        assert plan.policy == "entries" and plan.sketch_reads and set(plan.stores) == {"e1", "e2"}
        assert plan.cost.expert_bytes <= plan.budget_bytes
    assert verify_snapshot(tmp_path / "m").ok
    explained = invoke(runner, ["explain", "--db", db, "m"])
    assert "sketch 1" in explained and "of the weighted task vectors' norm" in explained
    assert "deviation estimate" in explained and "before rounding to the output dtype" in explained


def test_entries_without_stores_and_store_deltas_without_base_are_one_line_errors(db, tmp_path, capsys):
    code, _, err = run_main(["plan", "--db", db, "--base", "base", "--experts", "e1", "--budget", "10%",
                             "--policy", "entries"], capsys)
    assert code != 0 and err.count("\n") == 1 and "--store-deltas" in err
    code, _, err = run_main(["analyze", "--db", db, "--store-deltas", tmp_path / "s"], capsys)
    assert code != 0 and err.startswith("error: --store-deltas needs --base")


def test_the_default_policy_says_which_it_took_and_why(db, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    plan = ["plan", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5",
            "--budget", "20%", "--json", "--no-progress"]
    before = json.loads(invoke(runner, plan))
    assert before["policy"] == "energy"
    assert any("policy energy (the default without delta stores)" in n and "--store-deltas DIR e1 e2" in n
               for n in before["notes"])

    built = invoke(runner, ["analyze", "--db", db, "--base", "base", "--store-deltas", tmp_path / "stores",
                            "--no-progress", "e1", "e2"])
    assert "nothing to do" not in built and "only the delta stores were built" in built
    after = json.loads(invoke(runner, plan))
    assert after["policy"] == "entries" and after["digest"] != before["digest"]
    assert any("policy entries (the default: every expert has a delta store)" in n for n in after["notes"])
    named = json.loads(invoke(runner, [*plan, "--policy", "entries"]))
    assert named["digest"] == after["digest"] and not any("the default" in n for n in named["notes"])

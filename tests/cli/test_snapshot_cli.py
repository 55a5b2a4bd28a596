"""Snapshot commands through the CLI: verify, explain, snapshots, lineage,
gc and recover."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import PlanError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from tests.fixtures.checkpoints import make_writable_tree
from mergepipe.txn.publish import write_marker
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog, clone_catalog, raw_layout

BLOCK_BYTES = 2048


@pytest.fixture(scope="module")
def merged(tiny_family, tmp_path_factory):
    """A catalog with one committed 30% TIES merge, and a saved plan that
    nothing executed."""
    root = tmp_path_factory.mktemp("snapcli")
    db = build_catalog(root / "catalog.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", weights=[1.0, 0.5], params={"density": 0.5}, budget="30%"))
        snapshot_id, manifest = Engine(catalog).execute(plan, out=root / "merged", model_id="merged")
        unused = Planner(catalog).plan(MergeRequest(base="base", experts=["e3"], operator="task_arithmetic", budget="50%"))
        catalog.plans.save(unused.digest, unused.to_json_str())
    return {"root": root, "db": db, "plan": plan, "snapshot_id": snapshot_id, "manifest": manifest,
            "out": root / "merged", "unused": unused}


@pytest.fixture
def db(merged, tmp_path):
    """A private copy of the catalog (the snapshot directory is shared, read-only)."""
    return clone_catalog(merged["db"], tmp_path / "catalog.db")


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _one_line_error(code, err):
    assert code not in (0, None)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err


# ----------------------------------------------------------------------------- verify


def test_verify_by_directory_and_by_snapshot_id(merged, db, runner):
    output = invoke(runner, ["verify", merged["out"]])
    assert "OK" in output and merged["manifest"].manifest_hash in output
    output = invoke(runner, ["verify", "--db", db, merged["snapshot_id"]])
    assert "OK" in output
    invoke(runner, ["verify", "--db", db, merged["snapshot_id"][:10]])  # a unique prefix


def test_verify_failures_name_the_file(merged, db, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(merged["out"], copy)
    make_writable_tree(copy)
    with open(copy / "config.json", "a") as fh:
        fh.write(" ")
    code, _, err = run_main(["verify", copy], capsys)
    _one_line_error(code, err)
    assert "config.json" in err
    code, _, err = run_main(["verify", "--db", db, "snap-doesnotexist"], capsys)
    _one_line_error(code, err)
    code, _, err = run_main(["verify", tmp_path / "nowhere"], capsys)
    _one_line_error(code, err)


def test_verify_of_something_that_is_not_a_directory_needs_db(tmp_path, capsys, monkeypatch):
    """A path that is not a directory: a ConfigError (exit code 2), without looking in a catalog. An id
    without --db is looked up in the default catalog, named first (here: one that does not exist)."""
    code, _, err = run_main(["verify", tmp_path / "nowhere"], capsys)
    _one_line_error(code, err)
    assert code == 2
    assert err == f"error: {tmp_path / 'nowhere'} is not a directory; give --db to verify a snapshot by id\n"
    monkeypatch.setenv("MERGEPIPE_DB", str(tmp_path / "none.db"))
    code, _, err = run_main(["verify", "snap-0123456789abcdef"], capsys)
    named, error = err.strip().splitlines()
    assert code == 1 and named == f"catalog: {tmp_path / 'none.db'} (from $MERGEPIPE_DB)"
    assert error.startswith(f"error: no catalog at {tmp_path / 'none.db'}")


# ----------------------------------------------------------------------------- explain


def test_explain_snapshot_json(merged, db, runner):
    data = json.loads(invoke(runner, ["explain", "--db", db, merged["snapshot_id"], "--json"]))
    plan, manifest = merged["plan"], merged["manifest"]
    assert data["snapshot_id"] == merged["snapshot_id"]
    assert data["plan_id"] == plan.digest
    assert data["planned_expert_bytes"] == plan.cost.expert_bytes
    assert data["realized_expert_bytes"] == manifest.cost.realized.expert_bytes
    assert data["full_expert_bytes"] == plan.cost.full_expert_bytes
    assert 0.0 < data["retained_energy"] < 1.0
    experts = {e["expert"]: e for e in data["experts"]}
    assert set(experts) == {"e1", "e2"}
    for expert_id, e in experts.items():
        assert e["planned_bytes"] == plan.cost.expert_bytes_by_model[expert_id]
        assert e["realized_bytes"] == manifest.cost.realized.expert_bytes_by_model[expert_id]
    assert abs(sum(e["share"] for e in experts.values()) - 1.0) < 1e-9
    tensors = {t["tensor"]: t for t in data["tensors"]}
    assert set(tensors) == set(raw_layout(merged["out"]))
    for name, t in tensors.items():
        for expert_id in ("e1", "e2"):
            assert t["read"][expert_id] == len(plan.reads_of(name, expert_id))
            assert t["read"][expert_id] <= t["changed"][expert_id] <= t["blocks"]
    assert sum(t["planned_bytes"] for t in tensors.values()) == plan.cost.expert_bytes


def test_explain_plan_and_tensor_filter(merged, db, runner):
    unused = merged["unused"]
    data = json.loads(invoke(runner, ["explain", "--db", db, unused.digest[:12], "--json", "--tensor", "layers.1."]))
    assert data["snapshot_id"] is None and data["realized_expert_bytes"] is None
    assert data["plan_id"] == unused.digest
    assert data["tensors"] and all("layers.1." in t["tensor"] for t in data["tensors"])
    table = invoke(runner, ["explain", "--db", db, merged["snapshot_id"]])
    for word in ("per expert", "per tensor", "e1", "e2", "delta energy (‖Δ‖²) kept", "model.embed_tokens.weight"):
        assert word in table


def test_explain_unknown_target_is_one_line(db, capsys):
    code, _, err = run_main(["explain", "--db", db, "nothing-like-this"], capsys)
    _one_line_error(code, err)
    assert code == 1
    assert "'nothing-like-this' is not a snapshot, merged model or plan" in err
    assert "mergepipe snapshots" in err and "mergepipe models" in err


def test_explain_accepts_the_merged_model_id(merged, db, runner):
    by_model = invoke(runner, ["explain", "--db", db, "merged", "--json"])
    by_snapshot = invoke(runner, ["explain", "--db", db, merged["snapshot_id"], "--json"])
    assert by_model == by_snapshot
    assert json.loads(by_model)["snapshot_id"] == merged["snapshot_id"]
    assert invoke(runner, ["explain", "--db", db, "merged"]) == invoke(runner, ["explain", "--db", db,
                                                                                merged["snapshot_id"]])


def test_explain_of_a_model_that_is_not_a_merge_is_a_config_error(db, capsys):
    code, _, err = run_main(["explain", "--db", db, "e1"], capsys)
    _one_line_error(code, err)
    assert code == 2 and "'e1' is not a merged snapshot" in err


def test_explain_an_ambiguous_plan_prefix_is_an_error(merged, db, capsys):
    """Seventeen plans: two of them share a first hex digit (pigeonhole)."""
    with Catalog.open(db) as catalog:
        for percent in range(1, 16):
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e3"], operator="task_arithmetic", budget=f"{percent}%"))
            catalog.plans.save(plan.digest, plan.to_json_str())
        ids = [p.id for p in catalog.plans.list()]
    assert len(set(ids)) >= 17
    shared = next(c for c in "0123456789abcdef" if sum(i.startswith(c) for i in ids) >= 2)
    code, _, err = run_main(["explain", "--db", db, shared], capsys)
    _one_line_error(code, err)
    assert f"plan prefix '{shared}' matches several plans" in err


def test_explain_an_ambiguous_snapshot_prefix_is_an_error(merged, db, capsys, tmp_path):
    with Catalog.open(db) as catalog:
        second, _ = Engine(catalog).execute(merged["unused"], out=tmp_path / "second", model_id="second")
    assert second != merged["snapshot_id"]
    code, _, err = run_main(["explain", "--db", db, "snap-"], capsys)
    _one_line_error(code, err)
    assert "snapshot prefix 'snap-' matches several snapshots" in err
    # a longer, unique prefix still works
    code, out, err = run_main(["explain", "--db", db, second[:12], "--json"], capsys)
    assert code == 0 and json.loads(out)["snapshot_id"] == second


def test_explain_tensor_filter_matching_nothing_is_a_config_error(merged, db, capsys):
    code, _, err = run_main(["explain", "--db", db, merged["snapshot_id"], "--tensor", "no.such.tensor"], capsys)
    _one_line_error(code, err)
    assert code == 2 and "no.such.tensor" in err


# ----------------------------------------------------------------------------- listing, lineage


def test_snapshots_lists_every_attempt(merged, db, runner):
    data = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    assert [(s["model_id"], s["status"], s["id"]) for s in data] == [("merged", "committed", merged["snapshot_id"])]
    table = invoke(runner, ["snapshots", "--db", db])
    assert "merged" in table and "committed" in table


def test_lineage_of_a_merge_of_merges(merged, db, runner, tmp_path):
    # the snapshot can be an expert (and its parents' tree is printed below it)
    with Catalog.open(db) as catalog:
        analyze(catalog, ["merged"], base_id="base", progress=False)  # planning never analyses
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["merged", "e3"], operator="task_arithmetic", weights=[0.5, 0.5]))
        Engine(catalog).execute(plan, out=tmp_path / "second", model_id="second")
    output = invoke(runner, ["lineage", "--db", db, "second"])
    lines = output.splitlines()
    assert lines[0].strip() == "second"
    assert any("merged" in line and "expert" in line for line in lines)
    assert any("e3" in line and "expert" in line for line in lines)
    # merged's own parents appear, nested deeper than merged
    merged_line = next(i for i, line in enumerate(lines) if "merged" in line)
    depth = lambda line: len(line) - len(line.lstrip(" │├└─"))  # noqa: E731
    nested = [line for line in lines[merged_line + 1:] if "e1" in line]
    assert nested and depth(nested[0]) > depth(lines[merged_line])
    with Catalog.open(db) as catalog:
        assert catalog.models.parents("second") == [("base", "base"), ("merged", "expert"), ("e3", "expert")]


def test_lineage_of_an_unknown_model_is_one_line(db, capsys):
    code, _, err = run_main(["lineage", "--db", db, "ghost"], capsys)
    _one_line_error(code, err)
    assert "ghost" in err


# ----------------------------------------------------------------------------- gc, recover


def test_gc_removes_stale_staging_keeps_saved_plans_unless_asked_and_never_a_snapshot(merged, db, runner, tmp_path):
    # an orphan staging directory beside a snapshot's output, owned by nobody
    orphan = merged["root"] / f".merged.mergepipe-staging-{'ab' * 16}"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    write_marker(orphan, "ab" * 16)  # as every staging directory MergePipe creates
    try:
        output = invoke(runner, ["gc", "--db", db])
        assert "removed 1 staging directory; kept 1 saved plan(s) no merge ran (--plans deletes them)" in output
        assert not orphan.exists()
    finally:
        shutil.rmtree(orphan, ignore_errors=True)
    with Catalog.open(db) as catalog:
        Plan.from_json(catalog.plans.get(merged["unused"].digest))  # a saved plan stays without --plans
    assert "deleted 1 saved plan(s) no merge ran" in invoke(runner, ["gc", "--db", db, "--plans"])
    with Catalog.open(db) as catalog:
        with pytest.raises(PlanError, match="unknown plan"):
            catalog.plans.get(merged["unused"].digest)
        Plan.from_json(catalog.plans.get(merged["plan"].digest))  # still there: a snapshot refers to it
        assert [s.status for s in catalog.snapshots.list()] == ["committed"]
    assert verify_snapshot(merged["out"]).ok
    # again: nothing left to do
    assert invoke(runner, ["gc", "--db", db, "--plans"]).strip() == "gc: removed 0 staging directories; deleted 0 " \
        "saved plan(s) no merge ran"


def test_recover_commits_a_snapshot_published_but_not_committed(merged, db, runner, tmp_path):
    class Crash(Exception):
        pass

    def crash_after_rename(step):
        if step == "renamed":
            raise Crash()

    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e2", "e3"], operator="linear", budget="100%"))
        with pytest.raises(Crash):
            Engine(catalog, on_step=crash_after_rename).execute(plan, out=tmp_path / "late", model_id="late")
        assert [s.status for s in catalog.snapshots.pending()] == ["pending"]
    assert verify_snapshot(tmp_path / "late").ok
    output = invoke(runner, ["recover", "--db", db])
    assert "committed 1" in output
    with Catalog.open(db) as catalog:
        assert catalog.snapshots.pending() == []
        assert catalog.models.exists("late")
        record = next(s for s in catalog.snapshots.list() if s.model_id == "late")
        assert record.status == "committed"
        assert record.manifest_hash == json.loads((tmp_path / "late" / "manifest.json").read_text())["manifest_hash"]
    assert "committed 0, aborted 0, removed 0" in invoke(runner, ["recover", "--db", db])


def test_an_exception_before_the_rename_aborts_and_cleans_up(db, tmp_path):
    def fail_when_written(step):
        if step == "written":
            raise RuntimeError("disk full, say")

    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1"], operator="task_arithmetic"))
        with pytest.raises(RuntimeError):
            Engine(catalog, on_step=fail_when_written).execute(plan, out=tmp_path / "out" / "m", model_id="m")
        assert [s.status for s in catalog.snapshots.list() if s.model_id == "m"] == ["aborted"]
        assert not catalog.models.exists("m")
    assert os.listdir(tmp_path / "out") == []

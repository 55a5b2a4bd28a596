"""Re-runs: a plan executed before gives the same snapshot again, at another location.

Each test starts from one committed TIES merge of model 'merged' whose output directory was then
deleted (as a user does), with a copy of every byte it had. Re-running the merge, or executing its
plan, must give back exactly those bytes (manifest and card included), the same snapshot id and
manifest hash, no new version, and a second location in the catalog; `verify` must say "missing"
for the deleted one. A re-run under another model id publishes the same snapshot under that id too
(an alias); a re-run that does not reproduce the bytes and a re-run killed mid-way publish nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from mergepipe.analysis.experts import check_unchanged
from mergepipe.catalog import Catalog
from mergepipe.engine import engine as engine_module
from mergepipe.engine.engine import Engine
from mergepipe.errors import EngineError
from mergepipe.manifest.manifest import SoftwareVersions
from mergepipe.spec.plan import Plan
from tests.fixtures.checkpoints import make_writable_tree
from tests.fixtures.cli import all_files, invoke, one_line_error, run_main, wide_runner
from tests.planner.support import build_catalog, clone_catalog, run_forked

BLOCK_BYTES = 2048
MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5", "--budget", "60%"]



def delete(directory: Path) -> None:
    make_writable_tree(directory)  # snapshots are published read-only
    shutil.rmtree(directory)


@pytest.fixture(scope="module")
def deleted(tiny_family, tmp_path_factory):
    """A catalog whose merge 'merged' was published at ``original`` and then deleted; what it held."""
    root = tmp_path_factory.mktemp("rerun")
    db = build_catalog(root / "catalog.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])
    original = root / "original"
    invoke(CliRunner(), ["merge", "--db", db, *MERGE, "--out", original, "--model-id", "merged", "--no-progress"])
    files = all_files(original)
    manifest = json.loads(files["manifest.json"])
    with Catalog.open(db) as catalog:
        (record,) = catalog.snapshots.list()
    delete(original)
    plan_path = root / "plan.json"
    with Catalog.open(db) as catalog:
        plan_path.write_text(catalog.plans.get(record.plan_id))
    return {"root": root, "db": db, "original": original, "files": files, "plan_id": record.plan_id,
            "plan_path": plan_path, "snapshot_id": manifest["snapshot_id"],
            "manifest_hash": manifest["manifest_hash"]}


@pytest.fixture
def db(deleted, tmp_path):
    return clone_catalog(deleted["db"], tmp_path / "catalog.db")


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def locations(runner, db) -> list[tuple[str, bool, bool]]:
    """(path, exists, current) of every location of the only snapshot, from `snapshots --json`."""
    (record,) = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    return [(loc["path"], loc["exists"], loc["current"]) for loc in record["locations"]]



def test_deleted_output_is_missing_not_damaged(deleted, db, capsys):
    for target in ("merged", deleted["snapshot_id"][:12]):  # by model id, by snapshot id prefix
        err = one_line_error(*run_main(["verify", "--db", db, target], capsys)[::2])
        assert err == (f"error: snapshot {deleted['snapshot_id']} (model 'merged') is missing: {deleted['original']} "
                       f"no longer exists; re-materialise it with `mergepipe execute --db {db} --plan "
                       f"{deleted['plan_id'][:12]} --out DIR`\n")


def test_merge_again_after_deleting_the_output_rematerialises_it_in_place(deleted, db, runner):
    out = deleted["original"]
    try:
        output = invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "merged", "--no-progress"])
        assert f"re-materialised snapshot {deleted['snapshot_id']} of model 'merged' at {out}" in output
        assert all_files(out) == deleted["files"]  # every byte, manifest.json and README.md included
        assert locations(runner, db) == [(str(out), True, True)]  # the same path, made again: one location
        with Catalog.open(db) as catalog:
            assert [m.id for m in catalog.models.versions("merged")] == ["merged"]  # no new version
            assert catalog.models.get("merged").uri == str(out)
            check_unchanged(catalog, "merged")  # the new files' times were recorded
        assert "OK" in invoke(runner, ["verify", "--db", db, "merged"])
    finally:
        if out.exists():
            delete(out)  # the module's catalog says it is gone


def test_execute_plan_rematerialises_it_at_a_new_location(deleted, db, runner, tmp_path):
    new = tmp_path / "new"
    output = invoke(runner, ["execute", "--db", db, "--plan", deleted["plan_id"][:12], "--out", new, "--no-progress"])
    assert f"re-materialised snapshot {deleted['snapshot_id']} of model 'merged' at {new}" in output
    assert all_files(new) == deleted["files"]
    manifest = json.loads((new / "manifest.json").read_text())
    assert (manifest["snapshot_id"], manifest["manifest_hash"]) == (deleted["snapshot_id"], deleted["manifest_hash"])
    assert locations(runner, db) == [(str(deleted["original"]), False, False), (str(new), True, True)]
    # the model follows its bytes: verify by model id, lineage, explain and gc keep working
    assert f"OK {new}:" in invoke(runner, ["verify", "--db", db, "merged"])
    assert f"OK {new}:" in invoke(runner, ["verify", "--db", db, deleted["snapshot_id"]])
    lineage = json.loads(invoke(runner, ["lineage", "--db", db, "merged", "--format", "json"]))
    assert [(p["id"], p["role"]) for p in lineage["parents"]] == [("base", "base"), ("e1", "expert"),
                                                                   ("e2", "expert")]
    assert json.loads(invoke(runner, ["explain", "--db", db, "merged", "--json"]))["snapshot_id"] == \
        deleted["snapshot_id"]
    invoke(runner, ["gc", "--db", db])
    assert all_files(new) == deleted["files"]
    with Catalog.open(db) as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["committed"]
        assert catalog.models.get("merged").uri == str(new)


def test_a_copy_beside_an_existing_location_leaves_the_current_one(deleted, db, runner, tmp_path):
    first, copy = tmp_path / "first", tmp_path / "copy"
    for out in (first, copy):
        invoke(runner, ["execute", "--db", db, "--plan", deleted["plan_id"], "--out", out, "--model-id", "merged",
                        "--no-progress"])
    assert all_files(copy) == all_files(first) == deleted["files"]
    assert locations(runner, db) == [(str(deleted["original"]), False, False), (str(first), True, True),
                                     (str(copy), True, False)]


def test_another_model_id_publishes_the_same_snapshot_as_an_alias(deleted, db, runner, tmp_path):
    """The same merge asked for under another id: the same bytes and snapshot, registered as that id too."""
    out = tmp_path / "x"
    invoke(runner, ["execute", "--db", db, "--plan", deleted["plan_id"][:12], "--out", out, "--model-id", "other",
                    "--no-progress"])
    assert all_files(out) == deleted["files"]  # the manifest names the snapshot's own model, 'merged'
    with Catalog.open(db) as catalog:
        assert [(s.model_id, s.id) for s in catalog.snapshots.list()] == [("merged", deleted["snapshot_id"])]
        assert catalog.models.parents("other") == [("merged", "same snapshot")]
        assert catalog.models.get("other").uri == str(out)
        assert catalog.snapshots.of_model("other").out_path == str(out)


def test_another_merge_into_a_deleted_location_is_refused(deleted, db, capsys):
    """The catalog still records snapshot 'merged' there: only that snapshot may come back to it."""
    out = deleted["original"]
    code, _, err = run_main(["merge", "--db", db, *MERGE[:-1], "80%", "--out", out, "--model-id", "merged",
                             "--quiet"], capsys)
    one_line_error(code, err)
    assert err.startswith(f"error: output path {out} is where the catalog records model 'merged', deleted since: "
                          "only the same snapshot may be re-materialised there")
    assert not out.exists() and not [p for p in out.parent.iterdir() if "staging" in p.name]
    with Catalog.open(db) as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["committed"]
        assert [m.id for m in catalog.models.versions("merged")] == ["merged"]


def test_the_same_flags_over_a_new_expert_version_are_a_new_merge(deleted, db, runner, tiny_family, tmp_path):
    """`merge` plans again each time: an input's new version changes the plan digest, so it publishes the
    model's next version instead of re-materialising the old snapshot."""
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", tiny_family["e3"], "--new-version"])
    out = tmp_path / "out"
    output = invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "merged", "--no-progress"])
    assert "re-materialised" not in output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_id"] == "merged@2" and manifest["snapshot_id"] != deleted["snapshot_id"]
    assert [e["id"] for e in manifest["experts"]] == ["e1@2", "e2"]
    with Catalog.open(db) as catalog:
        assert [len(catalog.snapshots.locations(s.id)) for s in catalog.snapshots.list()] == [1, 1]


def test_a_plan_never_executed_needs_a_model_id(db, runner, tmp_path, capsys):
    output = invoke(runner, ["plan", "--db", db, *MERGE[:-1], "80%", "--save"])
    plan_id = output.strip().splitlines()[-1].split()[-1]
    code, _, err = run_main(["execute", "--db", db, "--plan", plan_id, "--out", tmp_path / "x", "--no-progress"],
                            capsys)
    one_line_error(code, err)
    assert err == f"error: plan {plan_id[:12]} was never executed: give the merged model's id (--model-id)\n"


def _other_software(monkeypatch):
    real = SoftwareVersions.current()
    monkeypatch.setattr(SoftwareVersions, "current", classmethod(lambda cls: dataclasses.replace(real,
                                                                                              mergepipe="9.9.9")))
    return "the manifest differs in software"


def _other_bytes(monkeypatch):
    copy = engine_module.copy_side_files

    def copy_and_add(inputs, staging):
        copy(inputs, staging)
        (staging / "extra.txt").write_text("not in the first run\n")

    monkeypatch.setattr(engine_module, "copy_side_files", copy_and_add)
    return "the output files differ (snapshot id snap-"


@pytest.mark.parametrize("change", [_other_software, _other_bytes], ids=["software", "bytes"])
def test_a_rerun_that_does_not_reproduce_the_snapshot_publishes_nothing(deleted, db, tmp_path, monkeypatch, change):
    what = change(monkeypatch)
    out = tmp_path / "out"
    with Catalog.open(db) as catalog:
        plan = Plan.from_json(catalog.plans.get(deleted["plan_id"]))
        with pytest.raises(EngineError) as info:
            Engine(catalog).execute(plan, out=out, model_id="merged")
        message = str(info.value)
        assert message.startswith(f"re-executing plan {deleted['plan_id'][:12]} did not reproduce its snapshot "
                                  f"{deleted['snapshot_id']}: {what}")
        assert "nothing was published" in message
        assert [loc.path for loc in catalog.snapshots.locations(deleted["snapshot_id"])] == [str(deleted["original"])]
        assert [loc.status for loc in catalog.snapshots.location_intents()] == ["committed", "aborted"]
        assert catalog.models.get("merged").uri == str(deleted["original"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog.db"]  # no output, no staging directory


# ----------------------------------------------------------------------------- crashes

#: Where each re-run is killed (SIGKILL, tests/planner/support.py): before the rename, nothing may be
#: left; after it, `recover` must commit the location.
CRASHES = {"step-written": "step:written", "during-writes": "write:3", "step-fsynced": "step:fsynced",
           "step-renamed": "step:renamed"}


@pytest.fixture(scope="module")
def crashed(deleted):
    root = deleted["root"] / "crashes"
    jobs = []
    for name, mode in CRASHES.items():
        (root / name / "parent").mkdir(parents=True)
        jobs.append({"db": str(clone_catalog(deleted["db"], root / name / "catalog.db")),
                     "plan": str(deleted["plan_path"]), "out": str(root / name / "parent" / "new"),
                     "model_id": "merged", "mode": mode})
    return root, dict(zip(CRASHES, run_forked(jobs, root / "runner")))


@pytest.mark.parametrize("scenario", sorted(CRASHES))
def test_a_rerun_killed_mid_way_leaves_one_location_or_recovers_the_second(deleted, crashed, scenario, runner):
    root, statuses = crashed
    assert statuses[scenario]["signal"] == signal.SIGKILL, statuses[scenario]
    db, parent = root / scenario / "catalog.db", root / scenario / "parent"
    published = scenario == "step-renamed"
    assert (parent / "new").exists() == published
    output = invoke(runner, ["recover", "--db", db])
    assert output.startswith(f"recover: committed {int(published)}, aborted {int(not published)}")
    assert sorted(p.name for p in parent.iterdir()) == (["new"] if published else [])  # no staging directory
    assert "recover: committed 0, aborted 0, removed 0" in invoke(runner, ["recover", "--db", db])  # idempotent
    with Catalog.open(db) as catalog:
        assert catalog.snapshots.location_intents("pending") == []
        assert [s.status for s in catalog.snapshots.list()] == ["committed"]
    if published:
        assert locations(runner, db) == [(str(deleted["original"]), False, False), (str(parent / "new"), True, True)]
        assert all_files(parent / "new") == deleted["files"]
        assert "OK" in invoke(runner, ["verify", "--db", db, "merged"])
    else:
        assert locations(runner, db) == [(str(deleted["original"]), False, True)]

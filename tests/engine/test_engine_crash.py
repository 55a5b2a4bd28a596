"""Crash safety: a merge SIGKILLed at any point leaves no partial output.

Each scenario runs the same stored plan in its own process (a forked child
of one runner interpreter, tests/planner/support.py ``run_forked``), with
its own copy of the catalog, and kills it with SIGKILL:

* at each publish step (``Engine(on_step=...)``): staged, written, fsynced,
  renamed, committed;
* in the middle of the reads (the 5th ``CheckpointSource.read``) and of the writes
  (the 3rd ``ShardWriter.write``), injected in the child, so
  the staging directory holds half-written shards.

Then: the output path either does not exist or verifies completely; after
``recover`` no staging directory is left, the catalog says committed iff the
output exists, nothing is pending, and a second ``recover`` changes nothing;
finally the same merge succeeds (or is already committed) with the manifest
hash and file bytes of an uninterrupted run in a separate catalog.
"""

from __future__ import annotations

import json
import signal

import pytest

from mergepipe.catalog import Catalog
from mergepipe.cli import main
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.planner.support import (
    build_catalog,
    clone_catalog,
    run_forked,
    snapshot_files,
)

BLOCK_BYTES = 2048
MODEL_ID = "crash-merge"

SCENARIOS = {
    "step-staged": "step:staged",
    "step-written": "step:written",
    "step-fsynced": "step:fsynced",
    "step-renamed": "step:renamed",
    "step-committed": "step:committed",
    "during-reads": "read:5",
    "during-writes": "write:3",
}
#: Scenarios killed after the rename: the output is complete.
PUBLISHED = {"step-renamed", "step-committed"}


@pytest.fixture(scope="module")
def crash_setup(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    template = build_catalog(root / "template.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])
    with Catalog.open(clone_catalog(template, root / "plan.db")) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", weights=[1.0, 0.6], params={"density": 0.5}, seed=1, budget="60%"))
    plan_path = root / "plan.json"
    plan_path.write_text(plan.to_json_str())
    assert 0 < plan.cost.expert_bytes < plan.cost.full_expert_bytes

    # the uninterrupted run, in a separate catalog
    with Catalog.open(clone_catalog(template, root / "reference.db")) as catalog:
        ref_id, ref_manifest = Engine(catalog).execute(plan, out=root / "reference" / "out", model_id=MODEL_ID)
        ref_outputs = catalog.snapshots.outputs(MODEL_ID)
    reference = {
        "outputs": ref_outputs,
        "snapshot_id": ref_id,
        "manifest_hash": ref_manifest.manifest_hash,
        "files": snapshot_files(root / "reference" / "out"),
    }

    # every scenario at once, each in its own process and catalog
    jobs = []
    for name, mode in SCENARIOS.items():
        workdir = root / name
        (workdir / "parent").mkdir(parents=True)
        db = clone_catalog(template, workdir / "catalog.db")
        jobs.append({"db": str(db), "plan": str(plan_path), "out": str(workdir / "parent" / "out"),
                     "model_id": MODEL_ID, "mode": mode})
    # and one more, for the CLI test below
    cli_dir = root / "cli-fsynced"
    (cli_dir / "parent").mkdir(parents=True)
    jobs.append({"db": str(clone_catalog(template, cli_dir / "catalog.db")), "plan": str(plan_path),
                 "out": str(cli_dir / "parent" / "out"), "model_id": MODEL_ID, "mode": "step:fsynced"})
    # and one killed after the rename, for the retry test below
    retry_dir = root / "cli-renamed"
    (retry_dir / "parent").mkdir(parents=True)
    jobs.append({"db": str(clone_catalog(template, retry_dir / "catalog.db")), "plan": str(plan_path),
                 "out": str(retry_dir / "parent" / "out"), "model_id": MODEL_ID, "mode": "step:renamed"})
    statuses = run_forked(jobs, root / "runner")
    results = dict(zip([*SCENARIOS, "cli-fsynced", "cli-renamed"], statuses))
    return {"root": root, "plan": plan, "reference": reference, "results": results, "template": template}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sigkill_leaves_nothing_or_everything_and_recovers(crash_setup, scenario):
    root, plan, reference = crash_setup["root"], crash_setup["plan"], crash_setup["reference"]
    status = crash_setup["results"][scenario]
    assert status["signal"] == signal.SIGKILL, status
    workdir = root / scenario
    parent, out = workdir / "parent", workdir / "parent" / "out"

    # before recovery: no output, or a complete one
    assert out.exists() == (scenario in PUBLISHED)
    if out.exists():
        report = verify_snapshot(out)
        assert report.ok, report.problems

    with Catalog.open(workdir / "catalog.db") as catalog:
        report = recover(catalog)
        assert not report.problems and not report.busy
        # no staging directory left, visible or hidden
        assert sorted(p.name for p in parent.iterdir()) == (["out"] if scenario in PUBLISHED else [])
        # the catalog agrees with the disk
        assert catalog.snapshots.pending() == []
        live = [s for s in catalog.snapshots.list() if s.status == "committed"]
        assert bool(live) == out.exists()
        assert catalog.models.exists(MODEL_ID) == out.exists()
        # idempotent
        assert not recover(catalog).changed

        if scenario in PUBLISHED:
            (record,) = live
            assert record.id == reference["snapshot_id"]
            assert record.manifest_hash == reference["manifest_hash"]
            assert [p for p, _ in catalog.models.parents(MODEL_ID)] == ["base", "e1", "e2"]
            # recover records the output provenance the merge would have (later merges can reuse it)
            recovered, merged = catalog.snapshots.outputs(MODEL_ID), reference["outputs"]
            assert recovered.keys() == merged.keys() and merged
            for block, found in recovered.items():  # the same keys and hashes; the engine's norms carry a margin
                want = merged[block]
                assert (found.key, found.hash, found.error) == (want.key, want.hash, want.error)
                assert (found.l2 is None) == (want.l2 is None)
                assert found.l2 is None or found.l2 <= want.l2 <= found.l2 * (1 + 2**-7) * (1 + 2**-8)
        else:
            snapshot_id, manifest = Engine(catalog).execute(Plan.from_json(plan.to_json_str()), out=out,
                                                            model_id=MODEL_ID)
            assert snapshot_id == reference["snapshot_id"]
            assert manifest.manifest_hash == reference["manifest_hash"]
    assert verify_snapshot(out).ok
    assert snapshot_files(out) == reference["files"]


def test_the_cli_recovers_a_crashed_merge_on_its_own(crash_setup):
    """No explicit `recover`: opening the catalog for writing (execute) does it."""
    status = crash_setup["results"]["cli-fsynced"]
    assert status["signal"] == signal.SIGKILL, status
    workdir = crash_setup["root"] / "cli-fsynced"
    parent, out = workdir / "parent", workdir / "parent" / "out"
    assert list(parent.iterdir()) and not out.exists()  # a staging directory is left behind
    main(["execute", "--db", str(workdir / "catalog.db"), "--plan", crash_setup["plan"].digest[:12],
          "--out", str(out), "--model-id", MODEL_ID, "--no-progress"])
    assert sorted(p.name for p in parent.iterdir()) == ["out"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["manifest_hash"] == crash_setup["reference"]["manifest_hash"]
    assert manifest["snapshot_id"] == crash_setup["reference"]["snapshot_id"]
    with Catalog.open(workdir / "catalog.db") as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["aborted", "committed"]


def test_retrying_the_command_after_a_crash_past_the_rename_commits_the_snapshot(crash_setup, capsys):
    status = crash_setup["results"]["cli-renamed"]
    assert status["signal"] == signal.SIGKILL, status
    workdir = crash_setup["root"] / "cli-renamed"
    out = workdir / "parent" / "out"
    try:
        main(["execute", "--db", str(workdir / "catalog.db"), "--plan", crash_setup["plan"].digest,
              "--out", str(out), "--model-id", MODEL_ID, "--no-progress"])
    except SystemExit:
        pass  # refusing to overwrite is fine; leaving the catalog behind the disk is not
    capsys.readouterr()
    with Catalog.open(workdir / "catalog.db") as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["committed"]

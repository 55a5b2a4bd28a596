"""recover(): the states a dead (or live) publisher can leave, against the real catalog."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from mergepipe.spec.canonical import canonical_json
from mergepipe.txn.publish import DirLock
from mergepipe.txn.publish import TransactionManager
from mergepipe.txn.publish import staging_path_for, write_marker
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from tests.manifest.factories import sha
from tests.txn.helpers import PLAN, finish_snapshot, publish_snapshot, write_checkpoint


class Stop(Exception):
    pass


def stop_at(step):
    def hook(name):
        if name == step:
            raise Stop(name)
    return hook


def dead_intent(catalog, out: Path, model_id: str = "merged", with_staging: bool = True):
    """What a publisher killed after recording its intent leaves behind."""
    intent_id = uuid.uuid4().hex
    staging = staging_path_for(out, intent_id)
    if with_staging:
        write_checkpoint(staging)
        write_marker(staging, intent_id)
    catalog.snapshots.add_intent(intent_id, PLAN, catalog.plans.get(PLAN), model_id, out, staging)
    return intent_id, staging


def status(catalog, intent_id):
    return catalog.snapshots.get(intent_id).status


def test_published_but_uncommitted_is_committed_once(catalog, parents, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Stop):
        publish_snapshot(catalog, out, "merged", parents, on_step=stop_at("renamed"))
    (intent,) = catalog.snapshots.pending()
    manifest = verify_snapshot(out).manifest
    report = recover(catalog)
    assert report.committed == [manifest.snapshot_id] and not report.aborted and not report.removed
    record = catalog.snapshots.get(manifest.snapshot_id)
    assert record.intent_id == intent.intent_id and record.manifest_hash == manifest.manifest_hash
    assert record.manifest == canonical_json(manifest.to_json()).decode()
    assert catalog.models.parents("merged") == [("base", "base"), ("e1", "expert")]
    assert not recover(catalog).changed and verify_snapshot(out).ok


def test_dead_intent_with_staging_is_aborted_and_cleaned(catalog, tmp_path):
    intent_id, staging = dead_intent(catalog, tmp_path / "out")
    report = recover(catalog)
    assert report.aborted == [intent_id] and report.removed == [staging] and not staging.exists()
    assert status(catalog, intent_id) == "aborted" and not (tmp_path / "out").exists()
    assert not recover(catalog).changed


def test_dead_intent_without_anything_on_disk_is_aborted(catalog, tmp_path):
    intent_id, _ = dead_intent(catalog, tmp_path / "out", with_staging=False)
    assert recover(catalog).aborted == [intent_id] and status(catalog, intent_id) == "aborted"


def test_read_only_staging_is_removed(catalog, tmp_path):
    from mergepipe.txn.publish import seal

    intent_id, staging = dead_intent(catalog, tmp_path / "out")
    seal(staging)  # killed after the chmod, before the rename
    assert recover(catalog).removed == [staging] and not staging.exists()


@pytest.mark.parametrize("mismatch", ["plan", "model", "corrupt", "foreign"])
def test_output_that_is_not_the_intents_snapshot_is_left_alone(catalog, parents, tmp_path, mismatch):
    out = tmp_path / "out"
    intent_id, staging = dead_intent(catalog, out, with_staging=False)
    write_checkpoint(out, seed=1)
    if mismatch != "foreign":
        finish_snapshot(out, "other" if mismatch == "model" else "merged",
                        plan_digest=sha("another plan") if mismatch == "plan" else PLAN, parents=parents)
    if mismatch == "corrupt":
        (out / "config.json").write_text("{}")
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir())
    report = recover(catalog)
    assert report.aborted == [intent_id] and report.committed == []
    assert len(report.problems) == 1 and str(out) in report.problems[0] and "left untouched" in report.problems[0]
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before


def test_live_publish_is_not_touched(catalog, parents, tmp_path):
    """recover runs whenever a catalog is opened for writing, maybe mid-merge elsewhere."""
    tm = TransactionManager()
    out = tmp_path / "out"
    area = tm.stage(out, record_intent=lambda a: catalog.snapshots.add_intent(
        a.intent_id, PLAN, catalog.plans.get(PLAN), "merged", a.out_path, a.path))
    write_checkpoint(area.path)
    report = recover(catalog)
    assert report.busy == [area.intent_id] and not report.changed and area.path.is_dir()
    assert status(catalog, area.intent_id) == "pending"
    tm.abort(area)


def test_orphan_staging_dirs_are_removed_but_nothing_else(catalog, parents, tmp_path):
    out = tmp_path / "snaps" / "merged"
    manifest = publish_snapshot(catalog, out, "merged", parents)  # makes tmp/snaps a known parent
    orphan_id = uuid.uuid4().hex
    orphan = staging_path_for(tmp_path / "snaps" / "gone", orphan_id)
    write_checkpoint(orphan)
    write_marker(orphan, orphan_id)
    locked = staging_path_for(tmp_path / "snaps" / "starting", uuid.uuid4().hex)
    locked.mkdir()
    keep = [tmp_path / "snaps" / ".hidden", tmp_path / "snaps" / "user-dir",
            tmp_path / "snaps" / ".x.mergepipe-staging-not-hex"]
    for path in keep:
        path.mkdir()
    elsewhere = staging_path_for(tmp_path / "unknown-parent" / "x", uuid.uuid4().hex)
    elsewhere.mkdir(parents=True)
    with DirLock.try_acquire(locked) as lock:  # a publisher between mkdir and record_intent
        assert lock is not None
        report = recover(catalog)
    assert report.removed == [orphan] and report.busy == [locked.name.rsplit("-", 1)[1]]
    assert not orphan.exists() and locked.is_dir() and elsewhere.is_dir()
    assert all(path.is_dir() for path in keep)
    assert verify_snapshot(out).ok and catalog.snapshots.get(manifest.snapshot_id).status == "committed"
    assert recover(catalog).removed == [locked]  # once its owner is gone


def test_commit_refused_by_catalog_is_reported_and_left_pending(catalog, parents, tmp_path):
    from mergepipe.analysis.register import register_model

    out = tmp_path / "out"
    with pytest.raises(Stop):
        publish_snapshot(catalog, out, "merged", parents, on_step=stop_at("renamed"))
    register_model(catalog, "merged", write_checkpoint(tmp_path / "squatter"))  # id taken meanwhile
    report = recover(catalog)
    assert report.committed == [] and report.aborted == [] and len(report.problems) == 1
    assert "committing intent" in report.problems[0] and "\n" not in report.problems[0]
    (intent,) = catalog.snapshots.pending()
    assert verify_snapshot(out).ok  # the snapshot itself is never touched

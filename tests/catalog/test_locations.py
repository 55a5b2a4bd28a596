"""Snapshot locations: the first one recorded at commit, more added by re-materialising, the
current one moved with the model's uri, and the migration that gives old catalogs theirs."""

from __future__ import annotations

import os
import shutil

import pytest

from mergepipe.analysis.experts import checkpoint_files
from mergepipe.catalog import Catalog, schema
from mergepipe.errors import CatalogError, StalePlanError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.catalog.helpers import db_dump, raw_db
from tests.catalog.test_snapshots import PARENTS, described, hash_blocks, plan_json


@pytest.fixture
def committed(family_catalog, tiny_family, tmp_path):
    """A catalog with snapshot 'snap-1' of model 'merged' committed at ``tmp_path/out``."""
    catalog = family_catalog
    for model_id in ("base", "e1", "e3"):
        hash_blocks(catalog, model_id)
    catalog.plans.save("plan1", plan_json(catalog))
    out = shutil.copytree(tiny_family["e2"], tmp_path / "out")
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".s1")
    catalog.snapshots.commit("i1", "snap-1", "mh", '{"m": 1}', described(catalog, out), PARENTS)
    return catalog, out


def _copy(source, dest):
    """A copy of a snapshot directory whose files get new times (as a re-materialisation has)."""
    shutil.copytree(source, dest, copy_function=shutil.copyfile)
    for name in os.listdir(dest):
        os.utime(dest / name, ns=(1_000_000_000, 1_000_000_000))
    return dest


def test_commit_records_the_first_location(committed, tmp_path):
    catalog, out = committed
    (location,) = catalog.snapshots.locations("snap-1")
    assert (location.intent_id, location.snapshot_id, location.path, location.status) == (
        "i1", "snap-1", str(out), "committed")
    assert location.staging_path == str(tmp_path / ".s1")
    assert location.committed_at == catalog.snapshots.get("snap-1").committed_at


def test_a_location_without_files_is_added_and_the_current_one_stays(committed, tmp_path):
    catalog, out = committed
    uri = catalog.models.get("merged").uri
    pending = catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2")
    assert (pending.status, pending.committed_at) == ("pending", None)
    assert catalog.snapshots.location_intents("pending") == [pending]
    assert [loc.path for loc in catalog.snapshots.locations("snap-1")] == [str(out)]  # pending: not a location
    location = catalog.snapshots.commit_location("i2")
    assert location.status == "committed" and location.committed_at is not None
    assert [loc.path for loc in catalog.snapshots.locations("snap-1")] == [str(out), str(tmp_path / "copy")]
    assert catalog.snapshots.get("snap-1").out_path == str(out)
    assert catalog.models.get("merged").uri == uri
    assert catalog.snapshots.commit_location("i2") == location  # recover may repeat it


def test_a_location_with_files_becomes_the_current_one(committed, tmp_path):
    catalog, out = committed
    new = _copy(out, tmp_path / "new")
    files = checkpoint_files(open_checkpoint(new))
    stats = {f.name: os.stat(new / f.name) for f in files}
    catalog.snapshots.add_location_intent("i2", "snap-1", new, tmp_path / ".s2")
    catalog.snapshots.commit_location("i2", files)
    assert catalog.snapshots.get("snap-1").out_path == str(new)
    assert catalog.models.get("merged").uri == str(new)
    recorded = catalog.models.files("merged")
    assert {f.name: (f.size, f.mtime_ns) for f in recorded} == {
        name: (st.st_size, st.st_mtime_ns) for name, st in stats.items()}
    assert all(f.mtime_ns == 1_000_000_000 for f in recorded)
    assert catalog.snapshots.of_model("merged").out_path == str(new)


def test_re_making_a_location_keeps_one_row_per_path(committed, tmp_path):
    catalog, out = committed
    catalog.snapshots.add_location_intent("i2", "snap-1", out, tmp_path / ".s2")
    catalog.snapshots.commit_location("i2")
    (location,) = catalog.snapshots.locations("snap-1")
    assert (location.intent_id, location.path) == ("i2", str(out))


def test_abort_and_state_refusals(committed, tmp_path):
    catalog, _ = committed
    catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2")
    catalog.snapshots.abort_location("i2")
    catalog.snapshots.abort_location("i2")  # idempotent
    assert catalog.snapshots.location("i2").status == "aborted"
    assert len(catalog.snapshots.locations("snap-1")) == 1
    with pytest.raises(CatalogError, match="location intent i2 is aborted, not pending; it cannot be committed"):
        catalog.snapshots.commit_location("i2")
    with pytest.raises(CatalogError, match="location intent i1 is committed; it cannot be aborted"):
        catalog.snapshots.abort_location("i1")
    with pytest.raises(CatalogError, match="unknown location intent 'nope'"):
        catalog.snapshots.location("nope")


@pytest.mark.parametrize("snapshot_id", ["snap-unknown", "snap"])  # unknown; a prefix is not an id
def test_only_a_committed_snapshot_gets_a_location(committed, tmp_path, snapshot_id):
    catalog, _ = committed
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match=f"snapshot '{snapshot_id}' is not a committed snapshot"):
        catalog.snapshots.add_location_intent("i2", snapshot_id, tmp_path / "copy", tmp_path / ".s2")
    with pytest.raises(ValueError, match="snapshot paths are stored absolute, got 'relative'"):
        catalog.snapshots.add_location_intent("i2", "snap-1", "relative", tmp_path / ".s2")
    assert db_dump(catalog.path) == before


def test_a_location_over_changed_inputs_is_refused(committed, tmp_path):
    catalog, _ = committed
    with catalog.transaction():  # e3's content is no longer what plan1 was made from
        catalog._db.write("UPDATE models SET content_fingerprint = 'other' WHERE id = 'e3'")
    before = db_dump(catalog.path)
    with pytest.raises(StalePlanError, match="model 'e3' .* its snapshot cannot be re-materialised"):
        catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2")
    assert db_dump(catalog.path) == before


def test_files_of_another_checkpoint_are_refused_and_change_nothing(committed, tiny_family, tmp_path):
    catalog, _ = committed
    catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2")
    before = db_dump(catalog.path)
    (real,) = catalog.models.files("merged")
    wrong = [real.model_copy(update={"size": real.size + 1})]
    with pytest.raises(CatalogError, match="are not those of snapshot snap-1; it cannot be moved there"):
        catalog.snapshots.commit_location("i2", wrong)
    assert db_dump(catalog.path) == before
    assert catalog.snapshots.location("i2").status == "pending"


def test_migration_gives_existing_snapshots_their_first_location(committed, tmp_path, monkeypatch):
    """A catalog as version 5 left it (no locations table) gets one location per committed snapshot."""
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:6])  # later migrations are applied already
    catalog, out = committed
    text = plan_json(catalog, note="another plan")
    catalog.snapshots.add_intent("i9", "plan2", text, "other", tmp_path / "o", tmp_path / ".s9")
    catalog.close()
    with raw_db(catalog.path) as conn:
        conn.execute(f"DROP TABLE snapshot_locations{' CASCADE' if conn.server else ''}")  # PG: aliases' key too
        conn.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")
        expected = conn.execute("SELECT intent_id, id, out_path, staging_path, 'committed', created_at, committed_at "
                                "FROM snapshots WHERE status = 'committed'")
    assert len(expected) == 1  # the pending intent i9 gets none
    with Catalog.open(catalog.path) as reopened:
        assert reopened.schema_version == 6
        rows = [tuple(r) for r in reopened._db.query(  # as migration 6 left it (later ones add columns)
            "SELECT intent_id, snapshot_id, path, staging_path, status, created_at, committed_at "
            "FROM snapshot_locations ORDER BY created_at, intent_id")]
        assert rows == expected
        assert rows[0][:3] == ("i1", "snap-1", str(out))

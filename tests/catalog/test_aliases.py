"""Aliases: a committed snapshot published under a second model id, at a location of its own.

The alias is a model row like the snapshot's (its files, tensors, blocks and content fingerprint),
at the alias's location, whose one parent is the snapshot's model (role ``same snapshot``); the
snapshot itself (id, model, out_path) does not change. An id that is taken, or about to be, is
refused before anything is written; an aborted alias registers nothing.
"""

from __future__ import annotations


import pytest

from mergepipe.analysis.experts import checkpoint_files
from mergepipe.catalog import Catalog, schema
from mergepipe.errors import CatalogError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.catalog.helpers import db_dump, raw_db
from tests.catalog.test_locations import _copy, committed  # noqa: F401  (the fixture)
from tests.catalog.test_snapshots import PARENTS, hash_blocks, plan_json


def _publish_alias(catalog, tmp_path, alias="other", name="copy", files=True):
    """An alias location of snap-1 at ``tmp_path/name``, committed (with the copy's files, or none)."""
    copy = _copy(tmp_path / "out", tmp_path / name)
    catalog.snapshots.add_location_intent(f"i-{name}", "snap-1", copy, tmp_path / f".s-{name}", model_id=alias)
    catalog.snapshots.commit_location(f"i-{name}", checkpoint_files(open_checkpoint(copy)) if files else None)
    return copy


def test_an_alias_is_the_snapshots_model_under_another_id_at_its_own_location(committed, tmp_path):
    catalog, out = committed
    hash_blocks(catalog, "merged")  # as `analyze` records them: the alias gets the same hashes
    copy = _publish_alias(catalog, tmp_path)
    owner, alias = catalog.models.get("merged"), catalog.models.get("other")
    assert (alias.kind, alias.uri, alias.name, alias.version) == ("snapshot", str(copy), "other", 1)
    assert (alias.fingerprint, alias.total_bytes, alias.n_tensors, alias.n_blocks) == (
        owner.fingerprint, owner.total_bytes, owner.n_tensors, owner.n_blocks)
    assert catalog.models.tensors("other") == catalog.models.tensors("merged")
    assert catalog.blocks.by_tensor("other") == catalog.blocks.by_tensor("merged")
    assert catalog.blocks.content_fingerprint("other") == catalog.blocks.content_fingerprint("merged")
    assert [(f.name, f.mtime_ns) for f in catalog.models.files("other")] == [
        (f.name, 1_000_000_000) for f in catalog.models.files("merged")]  # the copy's times
    assert catalog.models.parents("other") == [("merged", "same snapshot")]
    assert catalog.models.same_snapshot_as("other") == "merged" and catalog.models.same_snapshot_as("merged") is None
    # the snapshot is unchanged, and is found through either id, at either location
    record = catalog.snapshots.get("snap-1")
    assert (record.model_id, record.out_path) == ("merged", str(out))
    assert catalog.snapshots.of_model("merged") == record
    via_alias = catalog.snapshots.of_model("other")
    assert (via_alias.id, via_alias.model_id, via_alias.out_path) == ("snap-1", "merged", str(copy))
    assert catalog.snapshots.model_at("snap-1", copy) == "other" and catalog.snapshots.model_at("snap-1", out) == "merged"
    assert [loc.path for loc in catalog.snapshots.locations("snap-1")] == [str(out), str(copy)]


def test_without_files_an_alias_gets_the_recorded_ones(committed, tmp_path):
    """What ``recover`` commits when the snapshot's own directory still exists: the recorded files."""
    catalog, _ = committed
    _publish_alias(catalog, tmp_path, files=False)
    assert catalog.models.files("other") == catalog.models.files("merged")


def test_an_alias_made_again_elsewhere_moves_only_the_alias(committed, tmp_path):
    catalog, out = committed
    _publish_alias(catalog, tmp_path)
    again = _publish_alias(catalog, tmp_path, name="again")
    assert catalog.models.get("other").uri == str(again)
    assert catalog.snapshots.of_model("other").out_path == str(again)
    assert catalog.snapshots.get("snap-1").out_path == str(out) and catalog.models.get("merged").uri == str(out)
    assert [m.id for m in catalog.models.versions("other")] == ["other"]  # the same alias, not a new version


@pytest.mark.parametrize("taken, message", [
    ("e1", "model 'e1' is registered and is not snapshot snap-1 under another id"),
    ("merged-elsewhere", "a merge into model 'merged-elsewhere' is already in progress"),
])
def test_an_id_taken_or_being_published_is_refused_before_anything_is_written(committed, tmp_path, taken, message):
    catalog, _ = committed
    catalog.plans.save("plan2", plan_json(catalog, note="another plan"))
    catalog.snapshots.add_intent("i9", "plan2", catalog.plans.get("plan2"), "merged-elsewhere", tmp_path / "o",
                                 tmp_path / ".s9")
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match=message):
        catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2", model_id=taken)
    assert db_dump(catalog.path) == before


def test_a_pending_alias_holds_its_id_and_an_aborted_one_registers_nothing(committed, tmp_path):
    catalog, _ = committed
    catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2", model_id="other")
    catalog.plans.save("plan2", plan_json(catalog, note="another plan"))
    with pytest.raises(CatalogError, match="a merge into model 'other' is already in progress \\(intent i2\\)"):
        catalog.snapshots.add_intent("i9", "plan2", catalog.plans.get("plan2"), "other", tmp_path / "o",
                                     tmp_path / ".s9")
    catalog.snapshots.abort_location("i2")
    assert not catalog.models.exists("other") and catalog.snapshots.of_model("other") is None
    catalog.snapshots.add_intent("i9", "plan2", catalog.plans.get("plan2"), "other", tmp_path / "o", tmp_path / ".s9")


def test_the_snapshots_own_id_is_a_plain_location(committed, tmp_path):
    catalog, _ = committed
    catalog.snapshots.add_location_intent("i2", "snap-1", tmp_path / "copy", tmp_path / ".s2", model_id="merged")
    catalog.snapshots.commit_location("i2")
    assert catalog.snapshots.alias_published("i2") is None
    assert [m.id for m in catalog.models.list() if m.kind == "snapshot"] == ["merged"]


def test_migration_12_keeps_every_parent_and_allows_the_new_role(committed, tmp_path, monkeypatch):
    catalog, _ = committed
    path = catalog.path
    catalog.close()
    with raw_db(path) as conn:  # back to the schema before aliases: the old role CHECK, no alias table
        conn.execute("DROP TABLE snapshot_aliases")
        conn.execute("CREATE TABLE parents_v11 (model_id TEXT NOT NULL, position BIGINT NOT NULL, "
                     "parent_id TEXT NOT NULL, role TEXT NOT NULL CHECK (role IN ('base', 'expert')), "
                     f"PRIMARY KEY (model_id, position)){'' if conn.server else ' WITHOUT ROWID'}")
        conn.execute("INSERT INTO parents_v11 SELECT model_id, position, parent_id, role FROM model_parents")
        conn.execute("DROP TABLE model_parents")
        conn.execute("ALTER TABLE parents_v11 RENAME TO model_parents")
        conn.execute("UPDATE meta SET value = '11' WHERE key = 'schema_version'")
    monkeypatch.setattr(schema, "MIGRATIONS", tuple(m for m in schema.MIGRATIONS if m.version <= 12))
    with Catalog.open(path) as reopened:
        assert reopened.schema_version == 12
        assert reopened.models.parents("merged") == PARENTS
        _publish_alias(reopened, tmp_path)
        assert reopened.models.parents("other") == [("merged", "same snapshot")]

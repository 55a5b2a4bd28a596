"""Hub locations: the Hugging Face Hub commits a committed snapshot was pushed to, apart from its directories
(which `rm`, `recover` and `verify` act on), each commit recorded once, and the migration that adds them."""

from __future__ import annotations


import pytest

from mergepipe.catalog import Catalog, schema
from mergepipe.errors import CatalogError
from tests.catalog.helpers import db_dump, raw_db
from tests.catalog.test_locations import committed  # noqa: F401 - the fixture
from tests.catalog.test_snapshots import plan_json

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_a_push_is_recorded_once_per_commit_and_is_not_a_directory_location(committed):  # noqa: F811
    catalog, out = committed
    first = catalog.snapshots.add_hub_location("snap-1", "org/m", "main", SHA, private=False)
    assert (first.snapshot_id, first.repo_id, first.revision, first.commit, first.private) == (
        "snap-1", "org/m", "main", SHA, False)
    assert first.uri == f"hf://org/m@{SHA}" and first.pushed_at
    assert first.model_dump()["uri"] == first.uri
    # the same commit again (a push of files the repository held already) records nothing new
    again = catalog.snapshots.add_hub_location("snap-1", "org/m", "dev", SHA, private=True)
    assert again == first
    other = catalog.snapshots.add_hub_location("snap-1", "org/m", "dev", "f" * 40, private=True)
    assert catalog.snapshots.hub_locations("snap-1") == [first, other] == catalog.snapshots.hub_locations()
    # directories stay what `rm`, `recover` and `verify` see
    assert [loc.path for loc in catalog.snapshots.locations("snap-1")] == [str(out)]


def test_only_a_committed_snapshot_gets_a_hub_location(committed, tmp_path):  # noqa: F811
    catalog, _ = committed
    text = plan_json(catalog, note="another plan")
    catalog.snapshots.add_intent("i9", "plan2", text, "other", tmp_path / "o", tmp_path / ".s9")  # pending
    before = db_dump(catalog.path)
    for snapshot in ("i9", "nothing"):
        with pytest.raises(CatalogError, match="is not a committed snapshot"):
            catalog.snapshots.add_hub_location(snapshot, "org/m", "main", SHA, private=False)
    assert db_dump(catalog.path) == before


def test_migration_adds_the_table_to_a_catalog_without_it(committed, monkeypatch):  # noqa: F811
    catalog, _ = committed
    catalog.close()
    with raw_db(catalog.path) as conn:
        conn.execute("DROP TABLE hub_locations")
        conn.execute("UPDATE meta SET value = '13' WHERE key = 'schema_version'")
    monkeypatch.setattr(schema, "MIGRATIONS", tuple(m for m in schema.MIGRATIONS if m.version <= 14))
    with Catalog.open(catalog.path) as reopened:
        assert reopened.schema_version == 14
        assert reopened.snapshots.hub_locations("snap-1") == []
        assert reopened.snapshots.add_hub_location("snap-1", "org/m", "main", SHA, private=False).commit == SHA

"""The catalog file's life cycle (create/open, foreign files, migrations) and
its transactions, shared by every store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from mergepipe.analysis.experts import describe_checkpoint
from mergepipe.catalog import DEFAULT_BLOCK_BYTES, Catalog, schema
from mergepipe.errors import CatalogError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.catalog.helpers import db_dump, raw_db


def test_create_sets_wal_foreign_keys_and_meta(tmp_path: Path):
    with Catalog.create(tmp_path / "c.db") as cat:
        assert cat.block_bytes == DEFAULT_BLOCK_BYTES
        assert cat.schema_version == schema.MIGRATIONS[-1].version
        assert cat._db.query("PRAGMA journal_mode") == [("wal",)]
        assert cat._db.query("PRAGMA foreign_keys") == [(1,)]
        assert cat._db.query_one("PRAGMA busy_timeout")[0] >= 10_000
    conn = sqlite3.connect(tmp_path / "c.db")
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    conn.close()
    assert meta["magic"] == schema.CATALOG_MAGIC
    assert meta["block_bytes"] == str(DEFAULT_BLOCK_BYTES)


def test_create_is_idempotent(tmp_path: Path):
    path = tmp_path / "c.db"
    Catalog.create(path, block_bytes=4096).close()
    before = db_dump(path)
    Catalog.create(path, block_bytes=4096).close()
    with Catalog.create(path) as cat:  # no size given: whatever the catalog has
        assert cat.block_bytes == 4096
    assert db_dump(path) == before


def test_create_refuses_other_block_size(tmp_path: Path):
    path = tmp_path / "c.db"
    Catalog.create(path, block_bytes=4096).close()
    with pytest.raises(CatalogError, match="block size 4096"):
        Catalog.create(path, block_bytes=8192)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_create_refuses_bad_block_size(tmp_path: Path, bad):
    with pytest.raises(ConfigError):
        Catalog.create(tmp_path / "c.db", block_bytes=bad)
    assert not (tmp_path / "c.db").exists()


def test_foreign_text_file_refused(tmp_path: Path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a database\n" * 20)
    for make in (Catalog.create, Catalog.open):
        with pytest.raises(CatalogError, match="is not a MergePipe catalog"):
            make(path)
    assert path.read_text().startswith("hello")


def test_foreign_sqlite_file_refused(tmp_path: Path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE people (name TEXT)")
    conn.commit()
    conn.close()
    before = db_dump(path)
    for make in (Catalog.create, Catalog.open):
        with pytest.raises(CatalogError, match="is not a MergePipe catalog"):
            make(path)
    assert db_dump(path) == before


def test_sqlite_with_meta_but_no_magic_refused(tmp_path: Path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    conn.execute("INSERT INTO meta VALUES ('magic', 'someone-else')")
    conn.commit()
    conn.close()
    with pytest.raises(CatalogError, match="is not a MergePipe catalog"):
        Catalog.open(path)


def test_open_missing_says_how_to_create(tmp_path: Path):
    path = tmp_path / "nope.db"
    with pytest.raises(CatalogError, match=r"no catalog at .*nope\.db; run `mergepipe init-db --db "):
        Catalog.open(path)
    assert not path.exists()


def test_create_in_missing_directory(tmp_path: Path):
    with pytest.raises(CatalogError, match="does not exist"):
        Catalog.create(tmp_path / "missing" / "c.db")


#: The version a test migration gets: one past the package's latest.
CURRENT = schema.MIGRATIONS[-1].version
NEXT = CURRENT + 1


def _v2(statement: str = "CREATE TABLE extra (x INTEGER)") -> schema.Migration:
    return schema.Migration(NEXT, "test: an extra table", (statement,))


def test_open_migrates_forward(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (_v2(),))
    with Catalog.open(path) as cat:
        assert cat.schema_version == NEXT
        assert cat._db.query("SELECT x FROM extra") == []  # the table exists
    with Catalog.open(path) as cat:  # already current: nothing to do
        assert cat.schema_version == NEXT


def test_failed_migration_rolls_back(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    broken = schema.Migration(NEXT, "half-broken", ("CREATE TABLE extra (x INTEGER)", "THIS IS NOT SQL"))
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (broken,))
    before = db_dump(path)
    with pytest.raises(CatalogError, match="syntax error") as info:
        Catalog.open(path)
    assert "\n" not in str(info.value)  # the driver error, translated to one line
    assert db_dump(path) == before
    monkeypatch.undo()
    with Catalog.open(path) as cat:
        assert cat.schema_version == CURRENT
        tables = {r[0] for r in cat._db.query("SELECT name FROM sqlite_master")}
        assert "extra" not in tables


def test_newer_schema_refused(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (_v2(),))
    Catalog.create(path).close()
    monkeypatch.undo()
    with pytest.raises(CatalogError, match=f"schema version {NEXT}, newer than this MergePipe knows"):
        Catalog.open(path)


def test_new_catalog_gets_all_migrations(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (_v2(),))
    with Catalog.create(tmp_path / "c.db") as cat:
        assert cat.schema_version == NEXT


def test_transaction_rolls_back_on_error(catalog):
    with pytest.raises(RuntimeError):
        with catalog.transaction():
            catalog.plans.save("p1", "{}")
            raise RuntimeError("boom")
    assert catalog.plans.list() == []
    assert not catalog.in_transaction


def test_nested_transaction_joins_outer(catalog):
    with pytest.raises(RuntimeError):
        with catalog.transaction():
            with catalog.transaction():
                catalog.plans.save("p1", "{}")
            assert catalog.in_transaction  # the inner block did not commit
            raise RuntimeError("boom")
    assert catalog.plans.list() == []
    with catalog.transaction():
        with catalog.transaction():
            catalog.plans.save("p2", "{}")
    assert [p.id for p in catalog.plans.list()] == ["p2"]


@pytest.mark.parametrize(
    "write",
    [
        lambda db: db.write("DELETE FROM plans"),
        lambda db: db.write_many("INSERT INTO plans (id, json, created_at) VALUES (?, ?, ?)", [("p", "{}", "t")]),
    ],
    ids=["write", "write_many"],
)
def test_low_level_writes_require_a_transaction(catalog, write):
    catalog.plans.save("p0", "{}")
    before = db_dump(catalog.path)
    with pytest.raises(AssertionError, match="inside `with catalog.transaction"):
        write(catalog._db)
    assert db_dump(catalog.path) == before


def test_other_connection_sees_nothing_until_commit(catalog):
    with raw_db(catalog.path) as other:
        with catalog.transaction():
            catalog.plans.save("p1", "{}")
            assert other.execute("SELECT count(*) FROM plans")[0][0] == 0
        assert other.execute("SELECT count(*) FROM plans")[0][0] == 1


def test_failing_statement_rolls_back_the_whole_transaction(catalog):
    with pytest.raises(CatalogError, match='no such table|relation "nowhere" does not exist'):
        with catalog.transaction():
            catalog.plans.save("p1", "{}")
            catalog._db.write("INSERT INTO nowhere VALUES (1)")
    assert catalog.plans.list() == []
    assert not catalog.in_transaction
    catalog.plans.save("p2", "{}")  # the connection is usable afterwards
    assert [p.id for p in catalog.plans.list()] == ["p2"]


def test_stores_write_in_one_transaction(catalog, tiny_family):
    """A model (models store) and its hashes (blocks store) in one transaction
    that then fails leave nothing behind; the same without the failure commits both."""
    content = describe_checkpoint(open_checkpoint(tiny_family["base"]), "m", "checkpoint", catalog.block_bytes, "t")
    first = content.blocks[0]
    before = db_dump(catalog.path)
    with pytest.raises(RuntimeError):
        with catalog.transaction():
            catalog.models.add(content)
            catalog.blocks.set_hashes("m", [(first.tensor, first.index, "ab" * 32)])
            catalog.plans.save("p1", "{}")
            assert catalog.models.exists("m")  # visible inside the transaction
            raise RuntimeError("boom")
    assert db_dump(catalog.path) == before
    assert not catalog.models.exists("m")

    with catalog.transaction():
        catalog.models.add(content)
        catalog.blocks.set_hashes("m", [(first.tensor, first.index, "ab" * 32)])
    with raw_db(catalog.path) as other:
        rows = other.execute("SELECT tensor, idx, hash FROM blocks WHERE model_id = 'm' AND hash IS NOT NULL")
    assert rows == [(first.tensor, first.index, "ab" * 32)]


def test_failed_commit_releases_the_write_lock(sqlite_catalog):
    """A COMMIT that fails (here: a foreign key checked only at commit) must end
    the transaction: later writes work and other connections can write. (PostgreSQL: test_postgres.py.)"""
    catalog = sqlite_catalog
    with pytest.raises(CatalogError, match="FOREIGN KEY constraint failed"):
        with catalog.transaction():
            catalog._db.write("PRAGMA defer_foreign_keys = ON")
            catalog._db.write(
                "INSERT INTO model_parents (model_id, position, parent_id, role) VALUES ('x', 0, 'y', 'base')"
            )
    assert not catalog.in_transaction
    other = sqlite3.connect(catalog.path, timeout=0.1, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # 'database is locked' while the failed transaction lingers
        other.execute("ROLLBACK")
    finally:
        other.close()
    catalog.plans.save("p1", "{}")
    assert [p.id for p in catalog.plans.list()] == ["p1"]
    assert db_dump(catalog.path).count("INSERT INTO \"model_parents\"") == 0


def test_query_row_is_the_one_row_of_an_aggregate(tmp_path: Path):
    with Catalog.create(tmp_path / "c.db") as cat:
        assert cat._db.query_row("SELECT count(*) FROM models") == (0,)
        with pytest.raises(CatalogError, match="no row from"):
            cat._db.query_row("SELECT id FROM models")

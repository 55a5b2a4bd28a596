"""Catalog file life cycle: create/open, foreign files, migrations, transactions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from mergepipe.catalog import schema
from mergepipe.catalog.db import DEFAULT_BLOCK_BYTES, Catalog
from mergepipe.errors import CatalogError, ConfigError
from tests.catalog.helpers import db_dump


def test_create_sets_wal_foreign_keys_and_meta(tmp_path: Path):
    with Catalog.create(tmp_path / "c.db") as cat:
        assert cat.block_bytes == DEFAULT_BLOCK_BYTES
        assert cat.schema_version == schema.MIGRATIONS[-1].version
        assert cat._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert cat._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert cat._conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 10_000
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


def _v2(statement: str = "CREATE TABLE extra (x INTEGER)") -> schema.Migration:
    return schema.Migration(2, "test: an extra table", (statement,))


def test_open_migrates_forward(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (_v2(),))
    with Catalog.open(path) as cat:
        assert cat.schema_version == 2
        cat._conn.execute("SELECT x FROM extra")  # the table exists
    with Catalog.open(path) as cat:  # already current: nothing to do
        assert cat.schema_version == 2


def test_failed_migration_rolls_back(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    broken = schema.Migration(2, "half-broken", ("CREATE TABLE extra (x INTEGER)", "THIS IS NOT SQL"))
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (broken,))
    with pytest.raises(sqlite3.OperationalError):
        Catalog.open(path)
    monkeypatch.undo()
    with Catalog.open(path) as cat:
        assert cat.schema_version == 1
        tables = {r[0] for r in cat._conn.execute("SELECT name FROM sqlite_master")}
        assert "extra" not in tables


def test_newer_schema_refused(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (_v2(),))
    Catalog.create(path).close()
    monkeypatch.undo()
    with pytest.raises(CatalogError, match="schema version 2, newer than this MergePipe knows"):
        Catalog.open(path)


def test_new_catalog_gets_all_migrations(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + (_v2(),))
    with Catalog.create(tmp_path / "c.db") as cat:
        assert cat.schema_version == 2


def test_transaction_rolls_back_on_error(catalog):
    with pytest.raises(RuntimeError):
        with catalog.transaction():
            catalog.save_plan("p1", "{}")
            raise RuntimeError("boom")
    assert catalog.list_plans() == []
    assert not catalog.in_transaction


def test_nested_transaction_joins_outer(catalog):
    with pytest.raises(RuntimeError):
        with catalog.transaction():
            with catalog.transaction():
                catalog.save_plan("p1", "{}")
            assert catalog.in_transaction  # the inner block did not commit
            raise RuntimeError("boom")
    assert catalog.list_plans() == []
    with catalog.transaction():
        with catalog.transaction():
            catalog.save_plan("p2", "{}")
    assert [p.id for p in catalog.list_plans()] == ["p2"]


def test_low_level_writes_require_a_transaction(catalog):
    with pytest.raises(AssertionError, match="inside `with catalog.transaction"):
        catalog._write("DELETE FROM plans")


def test_other_connection_sees_nothing_until_commit(catalog):
    other = sqlite3.connect(catalog.path)
    with catalog.transaction():
        catalog.save_plan("p1", "{}")
        assert other.execute("SELECT count(*) FROM plans").fetchone()[0] == 0
    assert other.execute("SELECT count(*) FROM plans").fetchone()[0] == 1
    other.close()

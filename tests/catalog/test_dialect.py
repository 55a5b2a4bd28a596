"""The SQL boundary: driver errors become one-line CatalogErrors, and the
schema the dialect writes is the one the migrations describe."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog, database as dialect, schema
from mergepipe.catalog.database import SQLiteDialect
from mergepipe.errors import CatalogError
from tests.catalog.helpers import raw_db

# Tables whose rows hang off a parent key: stored WITHOUT ROWID (see schema.py).
WITHOUT_ROWID = {"meta", "models", "model_parents", "files", "tensors", "blocks", "analyses",
                 "block_deltas", "tensor_stats", "plans", "analyze_reads", "kernel_probes", "merge_timings"}


def stored_schema(path: Path) -> dict[str, str]:
    """name -> SQL text of every table and index, read with plain sqlite3."""
    conn = sqlite3.connect(path)
    try:
        return {name: sql for name, sql in conn.execute("SELECT name, sql FROM sqlite_master") if sql}
    finally:
        conn.close()


def one_line(sql: str) -> str:
    return " ".join(sql.split())


# -- errors -------------------------------------------------------------------------


def test_locked_catalog_is_a_catalog_error(tmp_path, monkeypatch):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    monkeypatch.setattr(dialect, "BUSY_TIMEOUT_SECONDS", 0.2)
    try:
        with Catalog.open(path) as catalog:  # reading is fine while another process writes
            assert catalog.plans.list() == []
            started = time.monotonic()
            with pytest.raises(CatalogError, match="is locked") as info:
                catalog.plans.save("p1", "{}")
            assert time.monotonic() - started < 10  # the patched timeout, not 30 s
            message = str(info.value)
            assert str(path) in message and "\n" not in message
            assert "0.2 s" in message  # it names the busy timeout
            assert not catalog.in_transaction
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with Catalog.open(path) as catalog:  # the lock is gone: writes work again
        catalog.plans.save("p1", "{}")
        assert [p.id for p in catalog.plans.list()] == ["p1"]


@pytest.mark.parametrize("content", [b"hello, this is not a database\n" * 20, b"SQLite format 3\x00" + b"\xff" * 200])
def test_non_sqlite_file_is_not_a_catalog(tmp_path, content):
    path = tmp_path / "c.db"
    path.write_bytes(content)
    for make in (Catalog.create, Catalog.open):
        with pytest.raises(CatalogError, match="is not a MergePipe catalog") as info:
            make(path)
        assert "\n" not in str(info.value)
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    "error, fragment",
    [
        (sqlite3.OperationalError("database is locked"), "is locked: another mergepipe process"),
        (sqlite3.OperationalError("database table is locked"), "is locked"),
        (sqlite3.OperationalError("database or disk is full"), "the disk is full, nothing was changed"),
        (sqlite3.DatabaseError("file is not a database"), "is not a MergePipe catalog"),
        (sqlite3.DatabaseError("database disk image is malformed"), "is damaged (database disk image is malformed)"),
        (sqlite3.OperationalError("attempt to write a readonly database"), "is read-only"),
        (sqlite3.IntegrityError("UNIQUE constraint failed: plans.id"), "refused a change that conflicts"),
        (sqlite3.OperationalError("disk I/O error"), "disk I/O error: the filesystem refused a read or write"),
        (sqlite3.OperationalError("unable to open database file"), "check that it has free space"),
        (sqlite3.OperationalError("no such table: x"), "no such table: x (an I/O or database error"),
    ],
)
def test_driver_errors_become_one_line(error, fragment):
    translated = SQLiteDialect().translate(error, Path("/x/catalog.db"))
    assert isinstance(translated, CatalogError)
    text = str(translated)
    assert fragment in text and "/x/catalog.db" in text and "\n" not in text


def test_constraint_violation_through_a_store_is_a_catalog_error(catalog):
    with pytest.raises(CatalogError, match="refused a change that conflicts with its records"):
        with catalog.transaction():
            catalog.plans.save("p1", "{}")
            catalog._db.write("INSERT INTO meta (key, value) VALUES ('magic', 'twice')")
    assert catalog.plans.list() == []


def test_writes_outside_a_transaction_are_refused(catalog):
    with pytest.raises(AssertionError):
        catalog._db.write("INSERT INTO plans (id, json, created_at) VALUES ('p', '{}', 't')")
    assert catalog.plans.list() == []


def test_nested_transactions_join(catalog):
    with catalog.transaction():
        with catalog.transaction():
            catalog.plans.save("p1", "{}")
        with raw_db(catalog.path) as other:  # the inner block committed nothing: other connections see no plan yet
            assert other.execute("SELECT count(*) FROM plans")[0][0] == 0
    assert [p.id for p in catalog.plans.list()] == ["p1"]


# -- schema -----------------------------------------------------------------------------


def _dropped(statements: list[str]) -> set[str]:
    """The tables a later migration drops."""
    return {m.group(1) for s in statements if (m := re.match(r"DROP TABLE (\w+)", s))}


def _columns_added(statements: list[str]) -> list[tuple[str, str]]:
    """(table, column) of every column ALTER statements add, as later drops and renames leave them (nothing of a
    dropped table)."""
    added: list[tuple[str, str]] = []
    for s in statements:
        if match := re.match(r"ALTER TABLE (\w+) ADD COLUMN (\w+)", s):
            added.append(match.groups())
        elif match := re.match(r"ALTER TABLE (\w+) DROP COLUMN (\w+)", s):
            added = [c for c in added if c != match.groups()]
        elif match := re.match(r"ALTER TABLE (\w+) RENAME COLUMN (\w+) TO (\w+)", s):
            table, old, new = match.groups()
            added = [(table, new) if c == (table, old) else c for c in added]
    return [c for c in added if c[0] not in _dropped(statements)]


def test_new_catalog_schema_is_the_migrations(tmp_path):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    stored = stored_schema(path)
    statements = [SQLiteDialect().ddl(s) for m in schema.MIGRATIONS for s in m.statements]
    added = _columns_added(statements)
    altered = {re.match(r"ALTER TABLE (\w+)", s).group(1) for s in statements if s.startswith("ALTER")}
    dropped = _dropped(statements)
    created = [one_line(s) for s in statements if s.lstrip().startswith("CREATE")  # not ALTER or data (UPDATE)
               and not any(re.search(rf"(TABLE|ON) {table}\b", s) for table in dropped)]
    # SQLite stores an altered table's CREATE with the new column appended
    assert sorted(one_line(sql) for name, sql in stored.items() if name not in altered) == sorted(
        sql for sql in created if not any(f"CREATE TABLE {table} " in sql for table in altered)
    )
    conn = sqlite3.connect(path)
    try:
        for table, column in added:
            assert column in {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    finally:
        conn.close()
    assert not any("{" in sql for sql in stored.values())  # every token filled


def test_tables_are_without_rowid_with_integer_columns(tmp_path):
    path = tmp_path / "c.db"
    Catalog.create(path).close()
    stored = stored_schema(path)
    conn = sqlite3.connect(path)
    try:
        for table in WITHOUT_ROWID:
            assert stored[table].rstrip().endswith("WITHOUT ROWID"), table
            with pytest.raises(sqlite3.OperationalError, match="no such column: rowid"):
                conn.execute(f"SELECT rowid FROM {table}")
        conn.execute("SELECT rowid FROM snapshots")  # the one rowid table
        types = {
            (table, name): kind
            for table in ("models", "blocks", "block_deltas")
            for _, name, kind, *_ in conn.execute(f"PRAGMA table_info({table})")
        }
    finally:
        conn.close()
    assert types[("models", "total_bytes")] == types[("blocks", "byte_end")] == "INTEGER"
    assert types[("block_deltas", "nnz")] == "INTEGER"
    assert types[("block_deltas", "l2")] == types[("block_deltas", "maxabs")] == "REAL"


def test_ddl_fills_the_tokens():
    statement = "CREATE TABLE t (a {int64} NOT NULL, b {float64}, c TEXT) {without_rowid}"
    assert SQLiteDialect().ddl(statement) == "CREATE TABLE t (a INTEGER NOT NULL, b REAL, c TEXT) WITHOUT ROWID"
    assert SQLiteDialect().ddl("CREATE INDEX i ON t(a)") == "CREATE INDEX i ON t(a)"
    with pytest.raises(KeyError):
        SQLiteDialect().ddl("CREATE TABLE t (a {int32})")  # an unknown token is an error, not text


def test_prefix_match_finds_prefixes_only(tmp_path):
    conn = sqlite3.connect(tmp_path / "p.db")
    try:
        conn.execute("CREATE TABLE t (id TEXT)")
        conn.executemany("INSERT INTO t VALUES (?)", [("abc1",), ("abc2",), ("xabc",), ("ab",)])
        condition = SQLiteDialect().prefix_match("id")
        rows = conn.execute(f"SELECT id FROM t WHERE {condition} ORDER BY id", (3, "abc")).fetchall()
    finally:
        conn.close()
    assert rows == [("abc1",), ("abc2",)]

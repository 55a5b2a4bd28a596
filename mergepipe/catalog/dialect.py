"""Everything about SQL that depends on the database engine, in one place.

The stores write plain SQL with ``?`` placeholders in the subset SQLite and
PostgreSQL share; what differs between them is here: connection settings,
how a write transaction begins, column types and table options in the
schema, placeholders, how to list tables, how a query gets a group's values
as one array, how a long read streams its rows, how many rows are inserted at
once, and how driver errors become one clear ``CatalogError``. ``Dialect`` is
what ``Database`` needs of one; ``SQLiteDialect`` is here, ``PostgresDialect`` in ``postgres.py`` (its driver
is an optional extra, imported only when a ``postgresql://`` catalog is opened).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from mergepipe.catalog.location import Location
from mergepipe.errors import CatalogError

#: How long a writer waits for another process's transaction before failing.
BUSY_TIMEOUT_SECONDS = 30.0


def not_a_catalog(path: Location) -> CatalogError:
    return CatalogError(f"{path} is not a MergePipe catalog; give another --db path (init-db creates a new one)")


class Dialect(Protocol):
    """What ``Database`` needs of a database engine."""

    name: str
    #: Driver exceptions the catalog boundary translates.
    errors: tuple[type[BaseException], ...]
    #: Statements that begin a write transaction holding the catalog's one write lock.
    begin_write: tuple[str, ...]
    #: The statement that begins a read-only transaction: one consistent view of every table.
    begin_read: str
    list_tables: str
    upsert_meta: str

    def prepare_new(self, conn: Any) -> None: ...

    def sql(self, statement: str) -> str: ...

    def ddl(self, statement: str) -> str: ...

    def prefix_match(self, column: str) -> str: ...

    def ordered_array(self, value: str, order: str) -> str | None: ...

    def stream_cursor(self, conn: Any, sql: str) -> Any: ...

    def insert_rows(self, conn: Any, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None: ...

    def is_conflict(self, exc: BaseException) -> bool: ...

    def translate(self, exc: BaseException, path: Location) -> CatalogError: ...


class SQLiteDialect:
    """SQLite 3 (the default: one file, WAL journal, many readers, queued writers)."""

    name = "sqlite"
    #: Driver exceptions the catalog boundary translates.
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    #: Takes the write lock at once, so two writers queue instead of deadlocking on upgrade.
    begin_write: tuple[str, ...] = ("BEGIN IMMEDIATE",)
    #: Deferred: in WAL mode the first read fixes the view the transaction sees, and takes no lock writers wait on.
    begin_read = "BEGIN"
    list_tables = "SELECT name FROM sqlite_master WHERE type = 'table'"
    upsert_meta = (
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"
    )
    #: Column types and table options of the schema's DDL, by token.
    ddl_tokens = {"int64": "INTEGER", "float64": "REAL", "without_rowid": "WITHOUT ROWID"}

    def connect(self, path: Path) -> sqlite3.Connection:
        """A connection with foreign keys on and a busy timeout; autocommit off
        (transactions are explicit, see ``Database.transaction``)."""
        try:
            conn = sqlite3.connect(
                str(path), timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None
            )
        except sqlite3.Error as exc:
            raise CatalogError(f"cannot open catalog {path}: {exc}") from None
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        except sqlite3.Error as exc:
            conn.close()
            raise self.translate(exc, path) from None
        return conn

    def prepare_new(self, conn: sqlite3.Connection) -> None:
        """Settings a new catalog file keeps for good (must run outside a transaction)."""
        conn.execute("PRAGMA journal_mode = WAL")

    def sql(self, statement: str) -> str:
        """A statement written with ``?`` placeholders, in this dialect."""
        return statement

    def ddl(self, statement: str) -> str:
        """A schema statement with its ``{token}`` types filled in."""
        return statement.format(**self.ddl_tokens)

    def prefix_match(self, column: str) -> str:
        """A condition true when ``column`` starts with the second parameter
        (the first is that parameter's length)."""
        return f"substr({column}, 1, ?) = ?"

    def ordered_array(self, value: str, order: str) -> str | None:
        """An aggregate of a group's ``value`` ordered by ``order`` that the driver returns as one Python list;
        None where one row per value is as cheap (SQLite runs in the process: no rows to send)."""
        return None

    def insert_rows(self, conn: sqlite3.Connection, table: str, columns: Sequence[str],
                    rows: Iterable[Sequence[object]]) -> None:
        """Insert ``rows`` into ``table``: one prepared statement run per row (in the process: cheap)."""
        conn.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                         rows)

    def stream_cursor(self, conn: sqlite3.Connection, sql: str) -> sqlite3.Cursor:
        """A cursor over ``sql``'s rows that reads them as they are fetched (sqlite3's always do)."""
        return conn.execute(sql, ())

    def is_conflict(self, exc: BaseException) -> bool:
        """Never: SQLite's writers queue on the file lock (``begin_write``) instead of failing."""
        return False

    def translate(self, exc: BaseException, path: Location) -> CatalogError:
        """One line a person can act on for a driver error."""
        text = str(exc)
        lowered = text.lower()
        if "locked" in lowered or "busy" in lowered:
            return CatalogError(
                f"catalog {path} is locked: another mergepipe process held its write lock for more than "
                f"{BUSY_TIMEOUT_SECONDS:g} s; wait for it to finish (`mergepipe snapshots` lists merges "
                "in progress) and retry"
            )
        if "disk is full" in lowered or "disk full" in lowered:
            return CatalogError(
                f"catalog {path}: the disk is full, nothing was changed; free space on its filesystem and retry"
            )
        if "i/o error" in lowered or "unable to open" in lowered:
            return CatalogError(
                f"catalog {path}: {text}: the filesystem refused a read or write; check that it has free space "
                "and is healthy, then retry (the catalog itself is not the problem)"
            )
        if "not a database" in lowered:
            return not_a_catalog(path)
        if "malformed" in lowered:
            return CatalogError(
                f"catalog {path} is damaged ({text}); restore it from a copy, or rebuild it with `mergepipe init-db` "
                "and `register`"
            )
        if "readonly" in lowered or "read-only" in lowered:
            return CatalogError(f"catalog {path} is read-only; check the file's permissions or give another --db")
        if isinstance(exc, sqlite3.IntegrityError):
            return CatalogError(
                f"catalog {path} refused a change that conflicts with its records ({text}); "
                "another process may have made the same change: retry"
            )
        return CatalogError(f"catalog {path}: {text} (an I/O or database error; check the disk and retry)")

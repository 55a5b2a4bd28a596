"""Opening a catalog file: connection settings, recognition, creation, migration.

A catalog is recognised by ``meta.magic``; an empty SQLite file is treated as
new, anything else without the magic is refused rather than written to.
Creation and migrations run under ``BEGIN IMMEDIATE`` and re-check the
state once the lock is held, so processes racing to create or upgrade the
same file do the work once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from mergepipe.catalog import schema
from mergepipe.errors import CatalogError

#: How long a writer waits for another process's transaction before failing.
BUSY_TIMEOUT_SECONDS = 30.0


def not_a_catalog(path: Path) -> CatalogError:
    return CatalogError(
        f"{path} is not a MergePipe catalog; give another --db path (init-db creates a new one)"
    )


def iso_timestamp(seconds: float) -> str:
    """Epoch seconds as an ISO-8601 UTC timestamp (millisecond precision)."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


def connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
    except sqlite3.Error as exc:
        raise CatalogError(f"cannot open catalog {path}: {exc}") from None
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
    except sqlite3.DatabaseError:
        conn.close()
        raise not_a_catalog(path) from None
    return conn


def read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str] | None:
    """The meta table of a MergePipe catalog; ``None`` for an empty database.

    Raises ``CatalogError`` for any other file (not SQLite, or SQLite
    without our magic).
    """
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None
        if "meta" not in tables:
            raise not_a_catalog(path)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError:
        raise not_a_catalog(path) from None
    if meta.get("magic") != schema.CATALOG_MAGIC:
        raise not_a_catalog(path)
    return meta


def initialise(conn: sqlite3.Connection, path: Path, block_bytes: int, clock: Callable[[], float]) -> None:
    """Give an empty database the schema and meta; migrate an existing catalog."""
    meta = read_meta(conn, path)
    if meta is None:
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # persistent; must be outside a transaction
        except sqlite3.OperationalError as exc:
            raise CatalogError(f"cannot create catalog {path}: {exc}") from None
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have initialised it while we waited for the lock.
            if read_meta(conn, path) is None:
                created = iso_timestamp(clock())
                apply_migrations(conn, 0)
                conn.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [("magic", schema.CATALOG_MAGIC), ("block_bytes", str(block_bytes)), ("created_at", created)],
                )
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    migrate(conn, path)


def stored_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return 0 if row is None else int(row[0])


def apply_migrations(conn: sqlite3.Connection, current: int) -> None:
    """Run every migration above ``current`` (inside the caller's transaction)."""
    for migration in schema.MIGRATIONS:
        if migration.version <= current:
            continue
        for statement in migration.statements:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(migration.version),),
        )


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    latest = schema.MIGRATIONS[-1].version
    current = stored_version(conn)
    if current > latest:
        raise CatalogError(
            f"catalog {path} has schema version {current}, newer than this MergePipe knows ({latest}); "
            "upgrade mergepipe"
        )
    if current == latest:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        apply_migrations(conn, stored_version(conn))  # re-read under the lock
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")

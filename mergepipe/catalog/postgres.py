"""PostgreSQL as the catalog's database: a catalog a team shares from several machines.

The stores' SQL is the subset SQLite and PostgreSQL share, so what is here is
small: the connection (psycopg 3, one per process, autocommit so that reads
hold nothing, transactions explicit), ``?`` placeholders as ``%s``, the
schema's column types, and driver errors as one ``CatalogError`` line each.

Writers behave as SQLite's: every write transaction first takes one
transaction-scoped advisory lock, the catalog's write lock (what ``BEGIN
IMMEDIATE`` is for SQLite), so check-then-write steps (the publish intent, a
snapshot commit, a new version) never interleave, on one machine or many;
readers never wait. Taking it waits at most ``dialect.BUSY_TIMEOUT_SECONDS``
(``lock_timeout``), then fails as SQLite's busy timeout does. A deadlock or
serialisation failure while beginning is retried ``CONFLICT_RETRIES`` times;
one in a transaction's body (which cannot be replayed here: the caller's code
runs in it) is reported as one line, and the transaction rolled back.

Text columns use the "C" collation whatever the database's default, so that
``ORDER BY`` is byte order as in SQLite (content fingerprints hash rows in
that order), and SQLite's ``REAL``/``INTEGER`` become 8-byte types.

psycopg is an optional extra (``mergepipe[postgres]``), imported when a
``postgresql://`` catalog is opened.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import import_module
from typing import Any

import mergepipe.catalog.dialect as dialect_module  # the module: tests shorten its busy timeout
from mergepipe.catalog.location import Location, ServerURL
from mergepipe.errors import CatalogError
from mergepipe.storage.credentials import redact

#: Attempts to begin a write transaction when the server reports a deadlock or serialisation failure.
CONFLICT_RETRIES = 5
#: Attempts to connect while the server says it is starting up or has too many clients.
CONNECT_RETRIES = 5
#: First pause between attempts (doubled each time).
RETRY_PAUSE_SECONDS = 0.05
#: The advisory lock key every write transaction of a catalog takes (advisory locks are per database).
WRITE_LOCK_KEY = int.from_bytes(hashlib.blake2b(b"mergepipe catalog write lock", digest_size=8).digest(),
                                "big", signed=True)
#: SQLSTATEs of a transaction that lost to another one and may simply run again.
CONFLICT_STATES = frozenset({"40001", "40P01"})
#: SQLSTATEs of a server not accepting connections for a moment (starting, too many clients).
BUSY_SERVER_STATES = frozenset({"57P03", "53300"})

_TYPES = ((re.compile(r"\bTEXT\b"), 'TEXT COLLATE "C"'), (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
          (re.compile(r"\bINTEGER\b"), "BIGINT"))


def _psycopg() -> Any:
    try:
        return import_module("psycopg")
    except ImportError:
        raise CatalogError("a postgresql:// catalog needs psycopg: pip install 'mergepipe[postgres]'") from None


def lock_key(name: str) -> int:
    """A 64-bit advisory lock key for ``name`` (an intent id: its owner holds it while alive)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


@lru_cache(maxsize=512)
def _placeholders(statement: str) -> str:
    return statement.replace("%", "%%").replace("?", "%s")


class PostgresConnection:
    """A psycopg connection with the few methods ``Database`` uses of sqlite3's."""

    def __init__(self, conn: Any, idle: Any) -> None:
        self._conn = conn
        self._idle = idle

    def execute(self, sql: str, params: Any = None) -> Any:
        # results in binary: the same Python values, parsed without text (half the time of a wide read
        # such as ``stats.block_norms``' arrays of floats)
        return self._conn.execute(sql, params, binary=True)

    def copy_rows(self, statement: str, rows: Iterable[Sequence[object]]) -> None:
        with self._conn.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)

    def server_cursor(self, sql: str) -> Any:
        cursor = self._conn.cursor(name="mergepipe_stream", binary=True)
        cursor.execute(sql)
        return cursor

    def executemany(self, sql: str, rows: Any) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(sql, rows)

    @property
    def in_transaction(self) -> bool:
        return bool(self._conn.info.transaction_status != self._idle)

    def close(self) -> None:
        self._conn.close()


class PostgresDialect:
    """PostgreSQL (a server many machines share; see the module docstring)."""

    name = "postgresql"
    begin_write: tuple[str, ...] = ("BEGIN", f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")
    begin_read = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
    list_tables = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
    upsert_meta = (
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"
    )
    ddl_tokens = {"int64": "BIGINT", "float64": "DOUBLE PRECISION", "without_rowid": ""}

    def __init__(self) -> None:
        self._driver = _psycopg()
        self.errors: tuple[type[BaseException], ...] = (self._driver.Error,)

    def connect(self, url: ServerURL) -> PostgresConnection:
        """One autocommit connection (transactions are explicit, see ``Database.transaction``) that waits
        at most the busy timeout for a lock."""
        timeout_ms = int(dialect_module.BUSY_TIMEOUT_SECONDS * 1000)
        pause = RETRY_PAUSE_SECONDS
        for attempt in range(CONNECT_RETRIES):
            try:
                conn = self._driver.connect(url.url, autocommit=True, options=f"-c lock_timeout={timeout_ms}",
                                            connect_timeout=10)
                break
            except self._driver.Error as exc:
                if _state(exc) not in BUSY_SERVER_STATES or attempt == CONNECT_RETRIES - 1:
                    raise CatalogError(f"cannot reach catalog {url}: {_one_line(exc, url)}") from None
                time.sleep(pause)
                pause *= 2
        return PostgresConnection(conn, self._driver.pq.TransactionStatus.IDLE)

    def prepare_new(self, conn: Any) -> None:
        """Nothing: a database keeps no per-file settings."""

    def sql(self, statement: str) -> str:
        """A statement written with ``?`` placeholders, with psycopg's ``%s`` instead."""
        return _placeholders(statement)

    def ddl(self, statement: str) -> str:
        """A schema statement with its tokens filled in and SQLite's types as PostgreSQL's (module docstring)."""
        text = statement.format(**self.ddl_tokens)
        for pattern, replacement in _TYPES:
            text = pattern.sub(replacement, text)
        return text

    def prefix_match(self, column: str) -> str:
        return f"substr({column}, 1, ?) = ?"

    def insert_rows(self, conn: PostgresConnection, table: str, columns: Sequence[str],
                    rows: Iterable[Sequence[object]]) -> None:
        """Insert ``rows`` into ``table`` with ``COPY``: one stream to the server, where a statement per row
        (``executemany``, even pipelined) made writing a 70B model's block rows several times SQLite's."""
        conn.copy_rows(f"COPY {table} ({', '.join(columns)}) FROM STDIN", rows)

    def stream_cursor(self, conn: PostgresConnection, sql: str) -> Any:
        """A server-side cursor over ``sql``'s rows, fetched batch by batch (a client-side one would hold
        every row of the result at once: millions for a catalog of 70B experts). Needs a transaction."""
        return conn.server_cursor(sql)

    def ordered_array(self, value: str, order: str) -> str | None:
        """``array_agg``: a wide result comes over the socket as one array per group instead of a row per
        value, each repeating the group's key (psycopg parses the array in C)."""
        return f"array_agg({value} ORDER BY {order})"

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a deadlock or serialisation failure: the transaction may run again."""
        return _state(exc) in CONFLICT_STATES

    def translate(self, exc: BaseException, path: Location) -> CatalogError:
        """One line a person can act on for a driver error."""
        state = _state(exc) or ""
        text = _one_line(exc, path)
        if state == "55P03":
            return CatalogError(
                f"catalog {path} is locked: another mergepipe process held its write lock for more than "
                f"{dialect_module.BUSY_TIMEOUT_SECONDS:g} s; wait for it to finish (`mergepipe snapshots` lists "
                "merges in progress) and retry"
            )
        if state in CONFLICT_STATES:
            return CatalogError(f"catalog {path}: a concurrent transaction conflicted with this one ({text}); "
                                "nothing was changed, retry")
        if state == "53100":
            return CatalogError(f"catalog {path}: the server's disk is full, nothing was changed; free space on "
                                "the database server and retry")
        if state.startswith("23"):
            return CatalogError(
                f"catalog {path} refused a change that conflicts with its records ({text}); "
                "another process may have made the same change: retry"
            )
        if state in ("25006", "42501"):
            return CatalogError(f"catalog {path} is read-only for this role ({text}); connect as a role that may "
                                "write its tables, or give another --db")
        if state.startswith("08") or state.startswith("57") or not state:
            return CatalogError(f"cannot reach catalog {path}: {text}; check the server and retry")
        return CatalogError(f"catalog {path}: {text} (a database error; check the server and retry)")


def _state(exc: BaseException) -> str | None:
    return getattr(exc, "sqlstate", None)


def _one_line(exc: BaseException, url: Location) -> str:
    """The server's primary message (or the driver's first line), on one line, without ``url``'s secrets."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    text = " ".join((primary or str(exc) or type(exc).__name__).split())
    return redact(text, url.secrets) if isinstance(url, ServerURL) else text

"""The catalog's connection: where it is (a SQLite file or a PostgreSQL URL), the dialects, explicit
transactions, driver errors as one-line ``CatalogError``s, meta, migrations and advisory locks.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import mergepipe.catalog.schema as schema
from mergepipe.errors import CatalogError, ConfigError
from mergepipe.storage.location import redact, split_url

#: URL schemes of a PostgreSQL catalog (libpq accepts both).
SERVER_SCHEMES = ("postgresql", "postgres")
#: Query keys of a URL that are secrets: left out of what is shown.
_SECRET_KEYS = frozenset({"password", "sslpassword"})
#: How long a writer waits for another process's transaction before failing.
BUSY_TIMEOUT_SECONDS = 30.0
#: Attempts to begin a write transaction when the server reports a deadlock or serialisation failure.
CONFLICT_RETRIES = 5
#: Attempts to connect while the server says it is starting up or has too many clients.
CONNECT_RETRIES = 5
#: First pause between attempts (doubled each time).
RETRY_PAUSE_SECONDS = 0.05
#: SQLSTATEs of a transaction that lost to another one and may simply run again.
CONFLICT_STATES = frozenset({"40001", "40P01"})
#: SQLSTATEs of a server not accepting connections for a moment (starting, too many clients).
BUSY_SERVER_STATES = frozenset({"57P03", "53300"})


def lock_key(name: str) -> int:
    """A 64-bit advisory lock key for ``name``."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


#: The advisory lock every write transaction of a server catalog takes (advisory locks are per database).
WRITE_LOCK_KEY = lock_key("mergepipe catalog write lock")


@dataclass(frozen=True)
class ServerURL:
    """A PostgreSQL catalog's URL, checked when made; ``str()`` is the URL without its password."""

    url: str

    def __post_init__(self) -> None:
        split_url(self.url)
        if re.search(r"%(?![0-9A-Fa-f]{2})", urlsplit(self.url).netloc.rpartition("@")[0]):
            raise ConfigError(
                f"catalog {self}: the user or password in the URL holds a % that starts no %XX "
                "escape; write a % there as %25"
            )

    @property
    def secrets(self) -> tuple[str, ...]:
        """The password and the secret query values, as typed: what no message may show (``redact``)."""
        parts = urlsplit(self.url)
        query = (p.partition("=") for p in parts.query.split("&"))
        return (parts.netloc.rpartition("@")[0].partition(":")[2], *(v for k, _, v in query if k in _SECRET_KEYS))

    def __str__(self) -> str:
        parts = urlsplit(self.url)
        userinfo, at, host = parts.netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}@{host}" if at else parts.netloc
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in _SECRET_KEYS])
        return f"postgresql://{netloc}{parts.path}" + (f"?{query}" if query else "")

    @property
    def sqlalchemy_url(self) -> str:
        """The URL as SQLAlchemy's psycopg 3 driver takes it, password included: for connecting only."""
        return "postgresql+psycopg://" + self.url.split("://", 1)[1]


#: What a catalog location is: a SQLite file or a PostgreSQL database.
Location = Path | ServerURL


def catalog_location(value: str | os.PathLike[str] | ServerURL) -> Location:
    """A path or URL as a ``Location``; another URL scheme is refused by name rather than taken for a file."""
    if isinstance(value, ServerURL):
        return value
    text = os.fspath(value)
    scheme, sep, _ = text.partition("://")
    if sep and scheme.lower() in SERVER_SCHEMES:  # libpq's defaults fill what it leaves out
        return ServerURL(text)
    if sep and scheme.isidentifier():
        raise CatalogError(f"--db {scheme}://...: a catalog is a SQLite file path or a postgresql:// URL")
    return Path(text)


def not_a_catalog(path: Location) -> CatalogError:
    return CatalogError(f"{path} is not a MergePipe catalog; give another --db path (init-db creates a new one)")


def _locked(path: Location) -> CatalogError:
    return CatalogError(
        f"catalog {path} is locked: another mergepipe process held its write lock for more than "
        f"{BUSY_TIMEOUT_SECONDS:g} s; wait for it to finish (`mergepipe snapshots` lists merges in progress) and retry"
    )


def _conflict(path: Location, text: str) -> CatalogError:
    return CatalogError(
        f"catalog {path} refused a change that conflicts with its records ({text}); "
        "another process may have made the same change: retry"
    )


class SQLiteDialect:
    """SQLite 3, the default: one file, WAL journal, many readers, queued writers."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    #: Takes the write lock at once, so two writers queue instead of deadlocking on upgrade.
    begin_write: tuple[str, ...] = ("BEGIN IMMEDIATE",)
    #: In WAL mode the first read fixes the view the transaction sees, and takes no lock writers wait on.
    begin_read = "BEGIN"
    list_tables = "SELECT name FROM sqlite_master WHERE type = 'table'"
    #: Column types and table options of the schema's DDL, by token.
    ddl_tokens = {"int64": "INTEGER", "float64": "REAL", "without_rowid": "WITHOUT ROWID"}

    def connect(self, path: Path) -> sqlite3.Connection:
        """A connection with foreign keys on, a busy timeout, and no implicit transactions."""
        try:
            conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
        except sqlite3.Error as exc:
            raise CatalogError(f"cannot open catalog {path}: {exc}") from None
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        except sqlite3.Error as exc:
            conn.close()
            raise self.translate(exc, path) from None
        return conn

    def sql(self, statement: str) -> str:
        """A statement written with ``?`` placeholders, in this dialect."""
        return statement

    def ddl(self, statement: str) -> str:
        return statement.format(**self.ddl_tokens)

    def prefix_match(self, column: str) -> str:
        """True when ``column`` starts with the second parameter (the first is its length)."""
        return f"substr({column}, 1, ?) = ?"

    def ordered_array(self, value: str, order: str) -> str | None:
        """A group's values as one list; None where a row per value is as cheap (in process)."""
        return None

    def execute(self, conn: Any, sql: str, params: Sequence[object]) -> Any:
        return conn.execute(sql, params)

    def insert_rows(self, conn: Any, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        conn.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})", rows)

    def stream_cursor(self, conn: Any, sql: str) -> Any:
        return conn.execute(sql, ())  # sqlite3 reads rows as they are fetched

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether the transaction lost to another and may run again (never: SQLite's writers queue)."""
        return False

    def translate(self, exc: BaseException, path: Location) -> CatalogError:
        text = str(exc)
        lowered = text.lower()
        if "locked" in lowered or "busy" in lowered:
            return _locked(path)
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
            return _conflict(path, text)
        return CatalogError(f"catalog {path}: {text} (an I/O or database error; check the disk and retry)")


_TYPES = (
    (re.compile(r"\bTEXT\b"), 'TEXT COLLATE "C"'),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
)


@lru_cache(maxsize=512)
def _placeholders(statement: str) -> str:
    return statement.replace("%", "%%").replace("?", "%s")


class PostgresDialect(SQLiteDialect):
    """PostgreSQL, a server many machines share: what differs from SQLite (docs/ARCHITECTURE.md, "Catalog")."""

    begin_write: tuple[str, ...] = ("BEGIN", f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")
    begin_read = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
    list_tables = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
    ddl_tokens = {"int64": "BIGINT", "float64": "DOUBLE PRECISION", "without_rowid": ""}

    def __init__(self) -> None:
        try:
            self._driver = import_module("psycopg")
        except ImportError:
            raise CatalogError("a postgresql:// catalog needs psycopg: pip install 'mergepipe[postgres]'") from None
        self.errors = (self._driver.Error,)

    def connect(self, url: ServerURL) -> Any:  # type: ignore[override]
        options, pause = f"-c lock_timeout={int(BUSY_TIMEOUT_SECONDS * 1000)}", RETRY_PAUSE_SECONDS
        for attempt in range(CONNECT_RETRIES):
            try:
                conn = self._driver.connect(url.url, autocommit=True, options=options, connect_timeout=10)
                break
            except self._driver.Error as exc:
                if _state(exc) not in BUSY_SERVER_STATES or attempt == CONNECT_RETRIES - 1:
                    raise CatalogError(f"cannot reach catalog {url}: {_one_line(exc, url)}") from None
            time.sleep(pause)
            pause *= 2
        return conn

    def sql(self, statement: str) -> str:
        return _placeholders(statement)

    def ddl(self, statement: str) -> str:
        text = super().ddl(statement)
        for pattern, replacement in _TYPES:
            text = pattern.sub(replacement, text)
        return text

    def ordered_array(self, value: str, order: str) -> str | None:
        return f"array_agg({value} ORDER BY {order})"

    def execute(self, conn: Any, sql: str, params: Sequence[object]) -> Any:
        return conn.execute(sql, params, binary=True)  # the same values, parsed without text: half a wide read's time

    def insert_rows(self, conn: Any, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        with conn.cursor() as cursor, cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)

    def stream_cursor(self, conn: Any, sql: str) -> Any:
        cursor = conn.cursor(name="mergepipe_stream", binary=True)  # on the server: a batch at a time
        cursor.execute(sql)
        return cursor

    def is_conflict(self, exc: BaseException) -> bool:
        return _state(exc) in CONFLICT_STATES

    def translate(self, exc: BaseException, path: Location) -> CatalogError:
        state = _state(exc) or ""
        text = _one_line(exc, path)
        if state == "55P03":
            return _locked(path)
        if state in CONFLICT_STATES:
            return CatalogError(
                f"catalog {path}: a concurrent transaction conflicted with this one ({text}); "
                "nothing was changed, retry"
            )
        if state == "53100":
            return CatalogError(
                f"catalog {path}: the server's disk is full, nothing was changed; free space on "
                "the database server and retry"
            )
        if state.startswith("23"):
            return _conflict(path, text)
        if state in ("25006", "42501"):
            return CatalogError(
                f"catalog {path} is read-only for this role ({text}); connect as a role that may "
                "write its tables, or give another --db"
            )
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


T = TypeVar("T")


class Database:
    """A connection, its dialect and the transaction in progress; every driver error leaves as a CatalogError."""

    def __init__(self, conn: Any, path: Location, dialect: SQLiteDialect) -> None:
        self._conn = conn
        #: The file or server URL (its text never shows a password): what messages name.
        self.path = path
        self.dialect = dialect
        self._depth = 0  # write transactions entered (nested ones join the outermost)
        self._reading = False  # in a read snapshot
        self._claims: set[str] = set()
        self._releasing: set[str] = set()  # claims given up in the transaction in progress

    @classmethod
    def connect(cls, path: Location) -> Database:
        if isinstance(path, ServerURL):
            server = PostgresDialect()
            return cls(server.connect(path), path, server)
        sqlite = SQLiteDialect()
        return cls(sqlite.connect(path), path, sqlite)

    @property
    def shared(self) -> bool:
        return isinstance(self.path, ServerURL)

    @property
    def url(self) -> str:
        return self.path.sqlalchemy_url if isinstance(self.path, ServerURL) else f"sqlite:///{self.path}"

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple]:
        with self._translated():
            return self.dialect.execute(self._conn, self.dialect.sql(sql), params).fetchall()

    def query_one(self, sql: str, params: Sequence[object] = ()) -> tuple | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def query_row(self, sql: str, params: Sequence[object] = ()) -> tuple:
        """The row of a statement that always returns one (an aggregate, a PRAGMA)."""
        row = self.query_one(sql, params)
        if row is None:
            raise CatalogError(f"catalog {self.path}: no row from `{sql}`")
        return row

    def grouped(self, sql: str, params: Sequence[object], make: Callable[[tuple], T]) -> dict[str, list[T]]:
        """The rows of a read statement grouped by their first column, in order, each made by ``make``."""
        out: dict[str, list[T]] = {}
        for row in self.query(sql, params):
            out.setdefault(row[0], []).append(make(row))
        return out

    def stream(self, sql: str, batch_rows: int = 10_000) -> Iterator[tuple[list[str], list[tuple]]]:
        """(column names, a batch of rows) of a read statement, in the transaction or a read snapshot of its own."""
        if not self._depth and not self._reading:
            with self.read_snapshot():
                yield from self.stream(sql, batch_rows)
            return
        with self._translated():
            cursor = self.dialect.stream_cursor(self._conn, self.dialect.sql(sql))
            try:
                names = [column[0] for column in cursor.description]
                while rows := cursor.fetchmany(batch_rows):
                    yield names, rows
            finally:
                cursor.close()

    def write(self, sql: str, params: Sequence[object] = ()) -> int:
        """Run one write statement in the current transaction; rows changed."""
        self._require_transaction()
        with self._translated():
            return int(self.dialect.execute(self._conn, self.dialect.sql(sql), params).rowcount)

    def write_many(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        self._require_transaction()
        with self._translated(), closing(self._conn.cursor()) as cursor:
            cursor.executemany(self.dialect.sql(sql), rows)

    def insert_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        """Insert many rows, as the dialect does it fastest."""
        self._require_transaction()
        with self._translated():
            self.dialect.insert_rows(self._conn, table, columns, rows)

    def upsert(self, table: str, key: Sequence[str], rows: Sequence[Mapping[str, object]]) -> None:
        """Insert ``rows`` (column -> value) in one transaction, each replacing the row of its ``key`` if any."""
        if not rows:
            return
        columns = list(rows[0])
        update = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
        values = ", ".join("?" * len(columns))
        with self.transaction():
            sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({values}) ON CONFLICT ({', '.join(key)})"
            self.write_many(f"{sql} DO UPDATE SET {update}", [list(row.values()) for row in rows])

    def _raw(self, sql: str) -> None:
        with self._translated():
            self._conn.execute(sql)

    def _require_transaction(self) -> None:
        if not self._depth:
            raise AssertionError("catalog writes must run inside `with catalog.transaction():`")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Begin a write transaction, commit it, or roll it back if the body raises; a nested one joins."""
        if self._reading:
            raise AssertionError("catalog writes cannot run inside a read snapshot")
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._begin()
        self._depth = 1
        try:
            yield
            self._depth = 0
            self._raw("COMMIT")
        except BaseException:
            self._depth = 0
            self._rollback()
            raise
        finally:
            releasing, self._releasing = self._releasing, set()
            for name in releasing:
                self.release(name)

    @contextmanager
    def read_snapshot(self) -> Iterator[None]:
        """A read-only transaction: every read in it sees the catalog as it was when it began."""
        if self._depth or self._reading:
            raise AssertionError("a read snapshot cannot begin inside a transaction")
        self._raw(self.dialect.begin_read)
        self._reading = True
        try:
            yield
        except BaseException:
            self._reading = False
            self._rollback()
            raise
        self._reading = False
        self._raw("ROLLBACK")  # it wrote nothing

    def _begin(self) -> None:
        """Begin a write transaction holding the write lock (a conflict is retried a few times)."""
        pause = RETRY_PAUSE_SECONDS
        for attempt in range(CONFLICT_RETRIES):
            try:
                for statement in self.dialect.begin_write:
                    self._conn.execute(statement)
                return
            except self.dialect.errors as exc:
                self._rollback()
                if not self.dialect.is_conflict(exc) or attempt == CONFLICT_RETRIES - 1:
                    raise self.dialect.translate(exc, self.path) from None
            time.sleep(pause)
            pause *= 2

    def _rollback(self) -> None:
        """Roll back while another error is on its way out, which it keeps."""
        try:
            self._conn.execute("ROLLBACK")
        except self.dialect.errors:
            pass

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    def claim(self, name: str) -> None:
        """Hold ``name`` (an intent id) until ``release`` or the connection ends."""
        if self.shared and name not in self._claims:
            self.query("SELECT pg_advisory_lock(?)", (lock_key(name),))
            self._claims.add(name)

    def release(self, name: str) -> None:
        """Give up a claim of this connection once the transaction in progress, if any, has ended."""
        if self._depth:
            self._releasing.add(name)
        elif name in self._claims:
            self._claims.discard(name)
            self.query("SELECT pg_advisory_unlock(?)", (lock_key(name),))

    def claimed_elsewhere(self, name: str) -> bool:
        """Whether another connection holds ``name``: its owner is alive."""
        if not self.shared:
            return False
        (taken,) = self.query_row("SELECT pg_try_advisory_lock(?)", (lock_key(name),))
        if taken:
            self.query("SELECT pg_advisory_unlock(?)", (lock_key(name),))
        return not taken

    def refresh_statistics(self) -> None:
        """After a bulk write, a server's query planner told about the new rows (SQLite needs nothing)."""
        if self.shared and not self.in_transaction:
            self._raw("ANALYZE")

    def table_names(self) -> set[str]:
        return {r[0] for r in self.query(self.dialect.list_tables)}

    def meta(self) -> dict[str, str] | None:
        """The meta table of a MergePipe catalog; None for an empty database; CatalogError for anything else."""
        tables = self.table_names()
        if not tables:
            return None
        meta = dict(self.query("SELECT key, value FROM meta")) if "meta" in tables else {}
        if meta.get("magic") != schema.CATALOG_MAGIC:
            raise not_a_catalog(self.path)
        return meta

    def initialise(self, block_bytes: int, created_at: str) -> None:
        """Give an empty database the schema and meta (once, whoever races); migrate an existing catalog."""
        if self.meta() is None:
            if not self.shared:  # a setting the file keeps for good
                self._raw("PRAGMA journal_mode = WAL")
            with self.transaction():
                if self.meta() is None:  # another process may have done it while we waited for the lock
                    self._apply_migrations(0)
                    meta = {"magic": schema.CATALOG_MAGIC, "block_bytes": str(block_bytes), "created_at": created_at}
                    self.write_many("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
        self.migrate()

    def schema_version(self) -> int:
        row = self.query_one("SELECT value FROM meta WHERE key = 'schema_version'")
        return 0 if row is None else int(row[0])

    def migrate(self) -> None:
        latest = schema.MIGRATIONS[-1].version
        current = self.schema_version()
        if current > latest:
            raise CatalogError(
                f"catalog {self.path} has schema version {current}, newer than this MergePipe knows "
                f"({latest}); upgrade mergepipe"
            )
        if current < latest:
            with self.transaction():
                self._apply_migrations(self.schema_version())  # re-read under the lock

    def _apply_migrations(self, current: int) -> None:
        for migration in (m for m in schema.MIGRATIONS if m.version > current):
            for statement in migration.statements:
                self.write(self.dialect.ddl(statement))
            self.set_meta("schema_version", str(migration.version))

    def set_meta(self, key: str, value: str) -> None:
        self.upsert("meta", ("key",), [{"key": key, "value": value}])

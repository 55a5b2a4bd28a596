"""The catalog's connection: transactions, error translation, meta and migrations.

One ``Database`` is shared by all stores of a ``Catalog``, so they write in
one transaction: ``with db.transaction():`` opens one (an inner one joins
the outer) and no write commits on its own. Every driver error is turned
into a ``CatalogError`` here, at the boundary (``dialect.translate``).

A catalog is recognised by ``meta.magic``; an empty database is treated as
new, anything else without the magic is refused rather than written to.
Creation and migrations run in a write transaction and re-check the state
once the lock is held, so processes racing to create or upgrade the same
file do the work once.

``location`` is a SQLite file or a PostgreSQL URL (``location.py``); the
dialect says what differs. ``claim`` marks a publish intent as having a live
owner where the catalog is shared (a server's session lock, released when
the owner's connection ends, even by SIGKILL); for a file, the staging
directory's ``flock`` says it (``txn/lock.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mergepipe.catalog.schema as schema  # the module, not its names: tests give it other migrations
from mergepipe.catalog.dialect import Dialect, SQLiteDialect, not_a_catalog
from mergepipe.catalog.location import Location, ServerURL
from mergepipe.catalog.postgres import CONFLICT_RETRIES, RETRY_PAUSE_SECONDS, PostgresDialect, lock_key
from mergepipe.errors import CatalogError


class Database:
    """A connection, its dialect and the transaction in progress."""

    def __init__(self, conn: Any, path: Location, dialect: Dialect) -> None:
        self._conn = conn
        #: The file or server URL (its text never shows a password): what messages name.
        self.path = path
        self.dialect = dialect
        self._depth = 0  # write transactions entered (nested ones join the outermost)
        self._reading = False  # in a read snapshot
        self._claims: set[str] = set()

    @classmethod
    def connect(cls, path: Location) -> Database:
        if isinstance(path, ServerURL):
            server = PostgresDialect()
            return cls(server.connect(path), path, server)
        sqlite = SQLiteDialect()
        return cls(sqlite.connect(path), path, sqlite)

    @property
    def shared(self) -> bool:
        """Whether this is a server catalog that other machines may use at the same time."""
        return isinstance(self.path, ServerURL)

    @property
    def url(self) -> str:
        """The catalog as a SQLAlchemy URL (``sqlite:///PATH``, ``postgresql+psycopg://...``), for libraries
        that keep their own tables in the same database (Optuna). It carries any password: never print it."""
        if isinstance(self.path, ServerURL):
            return self.path.sqlalchemy_url
        return f"sqlite:///{self.path}"

    def close(self) -> None:
        self._conn.close()

    # -------------------------------------------------------------- statements

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple]:
        """All rows of a read statement."""
        try:
            return self._conn.execute(self.dialect.sql(sql), params).fetchall()
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    def query_one(self, sql: str, params: Sequence[object] = ()) -> tuple | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def query_row(self, sql: str, params: Sequence[object] = ()) -> tuple:
        """The row of a statement that always returns one (an aggregate, a PRAGMA)."""
        row = self.query_one(sql, params)
        if row is None:
            raise CatalogError(f"catalog {self.path}: no row from `{sql}`")
        return row

    def stream(self, sql: str, batch_rows: int = 10_000) -> Iterator[tuple[list[str], list[tuple]]]:
        """(column names, up to ``batch_rows`` rows) of a read statement, batch by batch: for copying
        tables too large to hold at once (only a batch is in memory, on either backend). The statement runs
        when iteration starts, in the current transaction, else in a read snapshot of its own."""
        if not self._depth and not self._reading:
            with self.read_snapshot():
                yield from self.stream(sql, batch_rows)
            return
        try:
            cursor = self.dialect.stream_cursor(self._conn, self.dialect.sql(sql))
            try:
                names = [column[0] for column in cursor.description]
                while rows := cursor.fetchmany(batch_rows):
                    yield names, rows
            finally:
                cursor.close()
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    def write(self, sql: str, params: Sequence[object] = ()) -> int:
        """Run one write statement inside the current transaction; rows changed."""
        self._require_transaction()
        try:
            return self._conn.execute(self.dialect.sql(sql), params).rowcount
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    def write_many(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        self._require_transaction()
        try:
            self._conn.executemany(self.dialect.sql(sql), rows)
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    def insert_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        """Insert many rows into ``table`` inside the current transaction, as the dialect does it fastest
        (PostgreSQL: ``COPY``)."""
        self._require_transaction()
        try:
            self.dialect.insert_rows(self._conn, table, columns, rows)
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    def _raw(self, sql: str) -> None:
        """A statement outside the stores' SQL (transaction control, settings)."""
        try:
            self._conn.execute(sql)
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None

    # ------------------------------------------------------------ transactions

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Begin a write transaction, commit it, or roll it back if the body raises.

        Nested use joins the outer transaction (the inner block neither begins
        nor commits), so library functions compose into one transaction.
        """
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

    @contextmanager
    def read_snapshot(self) -> Iterator[None]:
        """A read-only transaction: every read in it sees the catalog as it was when it began (writers on
        other connections go on, unseen), so several tables read one after another agree with each other."""
        if self._depth or self._reading:
            raise AssertionError("a read snapshot cannot begin inside a transaction")
        try:
            self._conn.execute(self.dialect.begin_read)
        except self.dialect.errors as exc:
            raise self.dialect.translate(exc, self.path) from None
        self._reading = True
        try:
            yield
        finally:
            self._reading = False
            self._rollback()  # nothing to keep: it wrote nothing

    def _begin(self) -> None:
        """Begin a write transaction holding the write lock; a deadlock or serialisation failure while
        taking it is retried a bounded number of times (``postgres.py``)."""
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
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except self.dialect.errors:
            pass  # the database rolls back an unfinished transaction itself; keep the original error

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    # ------------------------------------------------------------ intent owners

    def claim(self, name: str) -> None:
        """Hold ``name`` (an intent id) for as long as this connection lives or until ``release``: other
        processes, on any machine, see it as owned (``claimed_elsewhere``). Nothing for a file catalog."""
        if self.shared and name not in self._claims:
            self.query("SELECT pg_advisory_lock(?)", (lock_key(name),))
            self._claims.add(name)

    def release(self, name: str) -> None:
        """Give up a claim of this connection (nothing if it holds none: another process's intent)."""
        if name in self._claims:
            self._claims.discard(name)
            self.query("SELECT pg_advisory_unlock(?)", (lock_key(name),))

    def claimed_elsewhere(self, name: str) -> bool:
        """Whether another connection holds ``name``: its owner is alive. Always False for a file catalog."""
        if not self.shared:
            return False
        (taken,) = self.query_row("SELECT pg_try_advisory_lock(?)", (lock_key(name),))
        if taken:
            self.query("SELECT pg_advisory_unlock(?)", (lock_key(name),))
        return not taken

    def _require_transaction(self) -> None:
        if not self._depth:
            raise AssertionError("catalog writes must run inside `with catalog.transaction():`")

    # ---------------------------------------------------------- meta, schema

    def refresh_statistics(self) -> None:
        """After a bulk write (an analysis: one row per block per expert), let a server's query planner see
        the new rows at once (PostgreSQL's ``ANALYZE``: planning a 70B merge scanned freshly written tables
        with a sort instead of their index until autovacuum got to them). Nothing for SQLite, whose primary
        keys serve those reads in order."""
        if self.shared and not self.in_transaction:
            self._raw("ANALYZE")

    def table_names(self) -> set[str]:
        """Every table of the database, MergePipe's and others' (Optuna's, of `search`)."""
        return {r[0] for r in self.query(self.dialect.list_tables)}

    def meta(self) -> dict[str, str] | None:
        """The meta table of a MergePipe catalog; ``None`` for an empty database.

        Raises ``CatalogError`` for anything else: not a database, a database
        without our magic, or an I/O error reading it (reported as such, not
        as "not a catalog").
        """
        tables = self.table_names()
        if not tables:
            return None
        if "meta" not in tables:
            raise not_a_catalog(self.path)
        meta = dict(self.query("SELECT key, value FROM meta"))
        if meta.get("magic") != schema.CATALOG_MAGIC:
            raise not_a_catalog(self.path)
        return meta

    def initialise(self, block_bytes: int, created_at: str) -> None:
        """Give an empty database the schema and meta; migrate an existing catalog."""
        if self.meta() is None:
            self.dialect.prepare_new(self._conn)
            with self.transaction():
                # Another process may have initialised it while we waited for the lock.
                if self.meta() is None:
                    self._apply_migrations(0)
                    self.write_many(
                        "INSERT INTO meta (key, value) VALUES (?, ?)",
                        [("magic", schema.CATALOG_MAGIC), ("block_bytes", str(block_bytes)),
                         ("created_at", created_at)],
                    )
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
        if current == latest:
            return
        with self.transaction():
            self._apply_migrations(self.schema_version())  # re-read under the lock

    def _apply_migrations(self, current: int) -> None:
        for migration in schema.MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.statements:
                self.write(self.dialect.ddl(statement))
            self.write(self.dialect.upsert_meta, ("schema_version", str(migration.version)))


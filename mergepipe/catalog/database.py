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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mergepipe.catalog.schema as schema  # the module, not its names: tests give it other migrations
from mergepipe.catalog.dialect import SQLiteDialect, not_a_catalog
from mergepipe.errors import CatalogError


class Database:
    """A connection, its dialect and the transaction in progress."""

    def __init__(self, conn: Any, path: Path, dialect: SQLiteDialect) -> None:
        self._conn = conn
        self.path = path
        self.dialect = dialect
        self._depth = 0

    @classmethod
    def connect(cls, path: Path, dialect: SQLiteDialect | None = None) -> Database:
        dialect = dialect or SQLiteDialect()
        return cls(dialect.connect(path), path, dialect)

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
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._raw(self.dialect.begin_write)
        self._depth = 1
        try:
            yield
            self._depth = 0
            self._raw("COMMIT")
        except BaseException:
            self._depth = 0
            try:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
            except self.dialect.errors:
                pass  # the database rolls back an unfinished transaction itself; keep the original error
            raise

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    def _require_transaction(self) -> None:
        if not self._depth:
            raise AssertionError("catalog writes must run inside `with catalog.transaction():`")

    # ---------------------------------------------------------- meta, schema

    def meta(self) -> dict[str, str] | None:
        """The meta table of a MergePipe catalog; ``None`` for an empty database.

        Raises ``CatalogError`` for anything else: not a database, a database
        without our magic, or an I/O error reading it (reported as such, not
        as "not a catalog").
        """
        tables = {r[0] for r in self.query(self.dialect.list_tables)}
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


"""The catalog: one SQLite file that knows every model, block and delta statistic.

``Catalog`` owns one connection (WAL journal, foreign keys on, a busy
timeout) so several processes can share one catalog file: readers never
block, and writers queue on ``BEGIN IMMEDIATE``. Transactions are explicit:
``with catalog.transaction():`` opens one (an inner one joins the outer), and
no write method commits on its own. Every SQL statement of MergePipe lives in
this package.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from mergepipe.catalog.connection import (
    BUSY_TIMEOUT_SECONDS,
    connect,
    initialise,
    iso_timestamp,
    migrate,
    not_a_catalog,
    read_meta,
)
from mergepipe.catalog.records import (
    MODEL_KINDS,
    PARENT_ROLES,
    BlockRecord,
    FileRecord,
    ModelRecord,
    ModelStatus,
    TensorRecord,
)
from mergepipe.catalog.register import ModelContent, checkpoint_files, fingerprint
from mergepipe.catalog.snapshots import PlansAndSnapshots
from mergepipe.catalog.statistics import AnalysisStore
from mergepipe.errors import CatalogError, ConfigError, ModelChangedError, UnknownModelError
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.checkpoint import open_checkpoint as open_checkpoint_dir

__all__ = ["BUSY_TIMEOUT_SECONDS", "DEFAULT_BLOCK_BYTES", "Catalog"]

#: 1 MiB blocks: large enough that per-block bookkeeping is negligible next to
#: the read, small enough that a budget can skip most of a tensor.
DEFAULT_BLOCK_BYTES = 1 << 20
# How many registered ids an "unknown model" message lists.
_MAX_IDS_IN_MESSAGE = 10

_MODEL_COLUMNS = (
    "id, uri, kind, fingerprint, architecture, num_layers, total_bytes, n_tensors, n_blocks, created_at"
)


class Catalog(AnalysisStore, PlansAndSnapshots):
    """A MergePipe catalog file. Make one with ``create`` or ``open``."""

    def __init__(self, conn: sqlite3.Connection, path: Path, clock: Callable[[], float]) -> None:
        self._conn = conn
        self._path = path
        self._clock = clock
        self._depth = 0
        self._block_bytes = int(self._meta()["block_bytes"])

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        block_bytes: int | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> Catalog:
        """Create the catalog at ``path``, or open it if it already exists.

        ``block_bytes`` defaults to ``DEFAULT_BLOCK_BYTES`` for a new catalog
        and to whatever an existing one uses. Block geometry is catalog-wide,
        so an existing catalog with a different explicit value is refused.
        """
        if block_bytes is not None and (
            isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0
        ):
            raise ConfigError(f"block size must be a positive number of bytes, got {block_bytes!r}")
        path = Path(path)
        if path.is_dir():
            raise CatalogError(f"{path} is a directory; give a file path for the catalog, e.g. {path}/catalog.db")
        if not path.parent.is_dir():
            raise CatalogError(f"cannot create a catalog at {path}: directory {path.parent} does not exist")
        conn = connect(path)
        try:
            initialise(conn, path, block_bytes or DEFAULT_BLOCK_BYTES, clock)
            catalog = cls(conn, path, clock)
        except BaseException:
            conn.close()
            raise
        if block_bytes is not None and catalog.block_bytes != block_bytes:
            catalog.close()
            raise CatalogError(
                f"catalog {path} already exists with block size {catalog.block_bytes} bytes, "
                f"not {block_bytes}; omit --block-bytes or use another --db path"
            )
        return catalog

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> Catalog:
        """Open an existing catalog, migrating its schema forward if needed."""
        path = Path(path)
        if not path.is_file():
            raise CatalogError(f"no catalog at {path}; run `mergepipe init-db --db {path}`")
        conn = connect(path)
        try:
            if read_meta(conn, path) is None:
                raise not_a_catalog(path)
            migrate(conn, path)
            return cls(conn, path, clock)
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def block_bytes(self) -> int:
        """Catalog-wide block size: every model's blocks are cut at this size."""
        return self._block_bytes

    @property
    def schema_version(self) -> int:
        return int(self._meta()["schema_version"])

    def now(self) -> str:
        """The injected clock as an ISO-8601 UTC timestamp."""
        return iso_timestamp(self._clock())

    # ---------------------------------------------------------------- transactions

    @contextmanager
    def transaction(self) -> Iterator[Catalog]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ``ROLLBACK`` if the body raises.

        Nested use joins the outer transaction (the inner block neither begins
        nor commits), so library functions can be composed in one transaction.
        """
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self._conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield self
        except BaseException:
            self._depth = 0
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        self._depth = 0
        self._conn.execute("COMMIT")

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    def _require_transaction(self) -> None:
        if not self._depth:
            raise AssertionError("catalog writes must run inside `with catalog.transaction():`")

    def _execute(self, sql: str, params: Sequence[object] = ()) -> sqlite3.Cursor:
        return self._conn.execute(sql, params)

    def _write(self, sql: str, params: Sequence[object] = ()) -> sqlite3.Cursor:
        self._require_transaction()
        return self._conn.execute(sql, params)

    def _write_many(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        self._require_transaction()
        self._conn.executemany(sql, rows)

    def _meta(self) -> dict[str, str]:
        return dict(self._execute("SELECT key, value FROM meta").fetchall())

    # ---------------------------------------------------------------------- models

    def find_model(self, model_id: str) -> ModelRecord | None:
        row = self._execute(f"SELECT {_MODEL_COLUMNS} FROM models WHERE id = ?", (model_id,)).fetchone()
        return None if row is None else ModelRecord(*row)

    def get_model(self, model_id: str) -> ModelRecord:
        record = self.find_model(model_id)
        if record is None:
            raise self._unknown(model_id)
        return record

    def model_exists(self, model_id: str) -> bool:
        return self._execute("SELECT 1 FROM models WHERE id = ?", (model_id,)).fetchone() is not None

    def list_models(self) -> list[ModelRecord]:
        rows = self._execute(f"SELECT {_MODEL_COLUMNS} FROM models ORDER BY created_at, id").fetchall()
        return [ModelRecord(*row) for row in rows]

    def _unknown(self, model_id: str) -> UnknownModelError:
        ids = [r[0] for r in self._execute("SELECT id FROM models ORDER BY id").fetchall()]
        if not ids:
            known = "none registered yet"
        else:
            known = "registered: " + ", ".join(ids[:_MAX_IDS_IN_MESSAGE])
            if len(ids) > _MAX_IDS_IN_MESSAGE:
                known += f" … ({len(ids)} in all)"
        return UnknownModelError(
            f"unknown model '{model_id}'; {known} (register it with `mergepipe register`)"
        )

    def _require_model(self, model_id: str) -> None:
        if not self.model_exists(model_id):
            raise self._unknown(model_id)

    def files(self, model_id: str) -> list[FileRecord]:
        rows = self._execute(
            "SELECT name, size, mtime_ns, header_sha256 FROM files WHERE model_id = ? ORDER BY position",
            (model_id,),
        ).fetchall()
        if not rows:
            self._require_model(model_id)
        return [FileRecord(*row) for row in rows]

    def tensors(self, model_id: str) -> list[TensorRecord]:
        """Every tensor of the model, in file order then offset order."""
        rows = self._execute(
            "SELECT name, file, dtype, shape, byte_begin, byte_end, ordinal FROM tensors "
            "WHERE model_id = ? ORDER BY ordinal",
            (model_id,),
        ).fetchall()
        if not rows:
            self._require_model(model_id)
        return [
            TensorRecord(name, file, dtype, tuple(json.loads(shape)), begin, end, ordinal)
            for name, file, dtype, shape, begin, end, ordinal in rows
        ]

    def blocks(self, model_id: str) -> dict[str, list[BlockRecord]]:
        """Tensor name -> its blocks in index order (tensors in file order)."""
        rows = self._execute(
            "SELECT b.tensor, b.idx, b.row_start, b.row_end, b.byte_begin, b.byte_end, b.hash "
            "FROM blocks b JOIN tensors t ON t.model_id = b.model_id AND t.name = b.tensor "
            "WHERE b.model_id = ? ORDER BY t.ordinal, b.idx",
            (model_id,),
        ).fetchall()
        if not rows:
            self._require_model(model_id)
        out: dict[str, list[BlockRecord]] = {}
        for row in rows:
            out.setdefault(row[0], []).append(BlockRecord(*row))
        return out

    def parents(self, model_id: str) -> list[tuple[str, str]]:
        """(parent id, role) in the order given at commit: the lineage of a snapshot."""
        self._require_model(model_id)
        rows = self._execute(
            "SELECT parent_id, role FROM model_parents WHERE model_id = ? ORDER BY position", (model_id,)
        ).fetchall()
        return [(p, r) for p, r in rows]

    def children(self, model_id: str) -> list[str]:
        """Models (snapshots) that have ``model_id`` as a parent."""
        rows = self._execute(
            "SELECT DISTINCT model_id FROM model_parents WHERE parent_id = ? ORDER BY model_id", (model_id,)
        ).fetchall()
        return [r[0] for r in rows]

    def model_status(self, model_id: str) -> ModelStatus:
        record = self.get_model(model_id)
        (hashed,) = self._execute(
            "SELECT count(*) FROM blocks WHERE model_id = ? AND hash IS NOT NULL", (model_id,)
        ).fetchone()
        bases = self._execute(
            "SELECT base_id FROM analyses WHERE expert_id = ? ORDER BY base_id", (model_id,)
        ).fetchall()
        return ModelStatus(model_id, hashed, record.n_blocks, tuple(b[0] for b in bases))

    # ------------------------------------------------------------ change detection

    def check_unchanged(self, model_id: str) -> None:
        """Raise ``ModelChangedError`` if any weight file's size or mtime moved
        since registration, or a file is gone."""
        record = self.get_model(model_id)
        root = Path(record.uri)
        for file in self.files(model_id):
            path = root / file.name
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise self._changed(model_id, f"{path} is missing") from None
            except OSError as exc:
                raise self._changed(model_id, f"{path}: {exc.strerror}") from None
            if st.st_size != file.size or st.st_mtime_ns != file.mtime_ns:
                raise self._changed(model_id, f"{path}")

    @staticmethod
    def _changed(model_id: str, what: str) -> ModelChangedError:
        return ModelChangedError(
            f"model '{model_id}' changed on disk since registration (file {what}); "
            "re-register it with `mergepipe register --force`"
        )

    def open_checkpoint(self, model_id: str) -> Checkpoint:
        """The model's checkpoint, after checking that it is still what was registered."""
        self.check_unchanged(model_id)
        record = self.get_model(model_id)
        checkpoint = open_checkpoint_dir(record.uri)
        if fingerprint(checkpoint_files(checkpoint)) != record.fingerprint:
            raise self._changed(model_id, f"headers in {record.uri}")
        return checkpoint

    # -------------------------------------------------------------- model writes

    def add_model(self, content: ModelContent, parents: Sequence[tuple[str, str]] = ()) -> None:
        """Insert a model with its files, tensors, blocks and parents.

        Low level: ``register_model`` and ``commit_snapshot`` decide whether
        a model may be added; this only writes it.
        """
        record = content.record
        if record.kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {record.kind!r}")
        with self.transaction():
            if self.model_exists(record.id):
                raise CatalogError(f"model '{record.id}' is already registered; use a new id")
            for parent_id, role in parents:
                if role not in PARENT_ROLES:
                    raise ValueError(f"parent role must be one of {PARENT_ROLES}, got {role!r}")
                self._require_model(parent_id)
            self._write(
                f"INSERT INTO models ({_MODEL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id, record.uri, record.kind, record.fingerprint, record.architecture,
                    record.num_layers, record.total_bytes, record.n_tensors, record.n_blocks,
                    record.created_at,
                ),
            )
            self._write_many(
                "INSERT INTO files (model_id, name, position, size, mtime_ns, header_sha256) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    (record.id, f.name, i, f.size, f.mtime_ns, f.header_sha256)
                    for i, f in enumerate(content.files)
                ),
            )
            self._write_many(
                "INSERT INTO tensors (model_id, name, file, dtype, shape, byte_begin, byte_end, ordinal) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (record.id, t.name, t.file, t.dtype, json.dumps(list(t.shape)), t.begin, t.end, t.ordinal)
                    for t in content.tensors
                ),
            )
            self._write_many(
                "INSERT INTO blocks (model_id, tensor, idx, row_start, row_end, byte_begin, byte_end, hash) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (record.id, b.tensor, b.index, b.row_start, b.row_end, b.begin, b.end, b.hash)
                    for b in content.blocks
                ),
            )
            self._write_many(
                "INSERT INTO model_parents (model_id, position, parent_id, role) VALUES (?, ?, ?, ?)",
                ((record.id, i, parent, role) for i, (parent, role) in enumerate(parents)),
            )

    def delete_model(self, model_id: str) -> None:
        """Remove a model and everything derived from it (hashes, analyses it is
        part of). Refused for snapshots and for parents of snapshots."""
        with self.transaction():
            record = self.get_model(model_id)
            if record.kind == "snapshot":
                raise CatalogError(
                    f"model '{model_id}' is a published snapshot and cannot be replaced; "
                    "register the new content under a new id"
                )
            children = self.children(model_id)
            if children:
                raise CatalogError(
                    f"model '{model_id}' is a parent of snapshot(s) {', '.join(children)} and cannot be "
                    "replaced; register the new content under a new id"
                )
            self._write("DELETE FROM models WHERE id = ?", (model_id,))

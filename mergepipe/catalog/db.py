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
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from mergepipe.catalog import schema
from mergepipe.catalog.records import (
    MODEL_KINDS,
    PARENT_ROLES,
    AnalysisRecord,
    BlockDelta,
    BlockRecord,
    FileRecord,
    ModelRecord,
    ModelStatus,
    TensorRecord,
    TensorStats,
)
from mergepipe.catalog.register import ModelContent, checkpoint_files, fingerprint
from mergepipe.catalog.snapshots import PlansAndSnapshots
from mergepipe.catalog.thresholds import TrimThreshold
from mergepipe.errors import CatalogError, ConfigError, ModelChangedError, UnknownModelError
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.checkpoint import open_checkpoint as open_checkpoint_dir

#: 1 MiB blocks: large enough that per-block bookkeeping is negligible next to
#: the read, small enough that a budget can skip most of a tensor.
DEFAULT_BLOCK_BYTES = 1 << 20
#: How long a writer waits for another process's transaction before failing.
BUSY_TIMEOUT_SECONDS = 30.0
# How many registered ids an "unknown model" message lists.
_MAX_IDS_IN_MESSAGE = 10

_MODEL_COLUMNS = (
    "id, uri, kind, fingerprint, architecture, num_layers, total_bytes, n_tensors, n_blocks, created_at"
)


def _foreign(path: Path) -> CatalogError:
    return CatalogError(
        f"{path} is not a MergePipe catalog; give another --db path (init-db creates a new one)"
    )


class Catalog(PlansAndSnapshots):
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
        conn = _connect(path)
        try:
            _initialise(conn, path, block_bytes or DEFAULT_BLOCK_BYTES, clock)
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
        conn = _connect(path)
        try:
            if _read_meta(conn, path) is None:
                raise _foreign(path)
            _migrate(conn, path)
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
        return datetime.fromtimestamp(self._clock(), timezone.utc).isoformat(timespec="milliseconds")

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

    # ------------------------------------------------------------------- analysis

    def set_block_hashes(self, model_id: str, hashes: Iterable[tuple[str, int, str]]) -> None:
        """Record content hashes as (tensor, block index, hex digest).

        Only NULL hashes are filled: a hash never changes for a registered
        model, so a concurrent analyse writing the same value is harmless.
        """
        with self.transaction():
            self._write_many(
                "UPDATE blocks SET hash = ? WHERE model_id = ? AND tensor = ? AND idx = ? AND hash IS NULL",
                ((digest, model_id, tensor, index) for tensor, index, digest in hashes),
            )

    def is_analyzed(self, expert_id: str, base_id: str) -> bool:
        row = self._execute(
            "SELECT 1 FROM analyses WHERE expert_id = ? AND base_id = ?", (expert_id, base_id)
        ).fetchone()
        return row is not None

    def analyses(self, model_id: str | None = None) -> list[AnalysisRecord]:
        """Recorded (expert, base) analyses, all or those involving ``model_id``."""
        sql = "SELECT expert_id, base_id, analyzed_at FROM analyses"
        params: tuple[str, ...] = ()
        if model_id is not None:
            sql += " WHERE expert_id = ? OR base_id = ?"
            params = (model_id, model_id)
        rows = self._execute(sql + " ORDER BY expert_id, base_id", params).fetchall()
        return [AnalysisRecord(*row) for row in rows]

    def record_analysis(
        self,
        expert_id: str,
        base_id: str,
        deltas: Iterable[BlockDelta],
        stats: Iterable[TensorStats],
    ) -> None:
        """Write one complete (expert, base) analysis; the ``analyses`` row is
        what marks it done, so partial results can never be mistaken for it."""
        with self.transaction():
            self._write(
                "INSERT INTO analyses (expert_id, base_id, analyzed_at) VALUES (?, ?, ?)",
                (expert_id, base_id, self.now()),
            )
            self._write_many(
                "INSERT INTO block_deltas (expert_id, base_id, tensor, idx, l2, maxabs, nnz, identical) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (expert_id, base_id, d.tensor, d.index, d.l2, d.maxabs, d.nnz, int(d.identical))
                    for d in deltas
                ),
            )
            self._write_many(
                "INSERT INTO tensor_stats (expert_id, base_id, tensor, numel, mergeable, identical, thresholds) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        expert_id, base_id, s.tensor, s.numel, int(s.mergeable), int(s.identical),
                        json.dumps([t.to_json() for t in s.thresholds.values()]) if s.mergeable else None,
                    )
                    for s in stats
                ),
            )

    def _require_analysis(self, expert_id: str, base_id: str) -> None:
        if not self.is_analyzed(expert_id, base_id):
            self._require_model(expert_id)
            self._require_model(base_id)
            raise CatalogError(
                f"model '{expert_id}' has not been analysed against '{base_id}'; "
                f"run `mergepipe analyze --base {base_id} {expert_id}`"
            )

    def block_deltas(self, expert_id: str, base_id: str) -> dict[str, list[BlockDelta]]:
        """Tensor name -> per-block delta statistics in block order (tensors in
        the expert's file order)."""
        self._require_analysis(expert_id, base_id)
        rows = self._execute(
            "SELECT d.tensor, d.idx, d.l2, d.maxabs, d.nnz, d.identical FROM block_deltas d "
            "JOIN tensors t ON t.model_id = d.expert_id AND t.name = d.tensor "
            "WHERE d.expert_id = ? AND d.base_id = ? ORDER BY t.ordinal, d.idx",
            (expert_id, base_id),
        ).fetchall()
        out: dict[str, list[BlockDelta]] = {}
        for tensor, index, l2, maxabs, nnz, identical in rows:
            out.setdefault(tensor, []).append(BlockDelta(tensor, index, l2, maxabs, nnz, bool(identical)))
        return out

    def tensor_stats(self, expert_id: str, base_id: str) -> dict[str, TensorStats]:
        """Tensor name -> per-tensor results (identical flag, thresholds)."""
        self._require_analysis(expert_id, base_id)
        rows = self._execute(
            "SELECT s.tensor, s.numel, s.mergeable, s.identical, s.thresholds FROM tensor_stats s "
            "JOIN tensors t ON t.model_id = s.expert_id AND t.name = s.tensor "
            "WHERE s.expert_id = ? AND s.base_id = ? ORDER BY t.ordinal",
            (expert_id, base_id),
        ).fetchall()
        out: dict[str, TensorStats] = {}
        for tensor, numel, mergeable, identical, thresholds in rows:
            parsed = [TrimThreshold.from_json(t) for t in json.loads(thresholds)] if thresholds else []
            out[tensor] = TensorStats(
                tensor, numel, bool(mergeable), bool(identical), {t.density: t for t in parsed}
            )
        return out

    def tensor_thresholds(self, expert_id: str, base_id: str) -> dict[str, dict[float, TrimThreshold]]:
        """Tensor name -> density -> exact trim threshold, for mergeable tensors."""
        return {
            name: stats.thresholds
            for name, stats in self.tensor_stats(expert_id, base_id).items()
            if stats.mergeable
        }


def _connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
    except sqlite3.Error as exc:
        raise CatalogError(f"cannot open catalog {path}: {exc}") from None
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
    except sqlite3.DatabaseError:
        conn.close()
        raise _foreign(path) from None
    return conn


def _read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str] | None:
    """The meta table of a MergePipe catalog; ``None`` for an empty database.

    Raises ``CatalogError`` for any other file (not SQLite, or SQLite
    without our magic).
    """
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None
        if "meta" not in tables:
            raise _foreign(path)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError:
        raise _foreign(path) from None
    if meta.get("magic") != schema.CATALOG_MAGIC:
        raise _foreign(path)
    return meta


def _initialise(conn: sqlite3.Connection, path: Path, block_bytes: int, clock: Callable[[], float]) -> None:
    """Give an empty database the schema and meta; migrate an existing catalog."""
    meta = _read_meta(conn, path)
    if meta is None:
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # persistent; must be outside a transaction
        except sqlite3.OperationalError as exc:
            raise CatalogError(f"cannot create catalog {path}: {exc}") from None
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have initialised it while we waited for the lock.
            if _read_meta(conn, path) is None:
                created = datetime.fromtimestamp(clock(), timezone.utc).isoformat(timespec="milliseconds")
                _apply(conn, 0)
                conn.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [("magic", schema.CATALOG_MAGIC), ("block_bytes", str(block_bytes)), ("created_at", created)],
                )
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    _migrate(conn, path)


def _stored_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return 0 if row is None else int(row[0])


def _apply(conn: sqlite3.Connection, current: int) -> None:
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


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    latest = schema.MIGRATIONS[-1].version
    current = _stored_version(conn)
    if current > latest:
        raise CatalogError(
            f"catalog {path} has schema version {current}, newer than this MergePipe knows ({latest}); "
            "upgrade mergepipe"
        )
    if current == latest:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        _apply(conn, _stored_version(conn))  # re-read under the lock
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")

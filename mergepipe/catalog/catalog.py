"""``Catalog``: the stores sharing one connection and one transaction; ``copy_catalog``, every record into an
empty catalog of either backend.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from mergepipe.catalog.database import Database, Location, ServerURL, SQLiteDialect, catalog_location, not_a_catalog
from mergepipe.catalog.models import BlockStore, ModelStore
from mergepipe.catalog.records import ModelStatus
from mergepipe.catalog.schema import MIGRATIONS
from mergepipe.catalog.snapshots import EvaluationStore, PlanStore, SearchStore, SnapshotStore, TimingStore
from mergepipe.catalog.statistics import DeltaStores, StatisticsStore
from mergepipe.errors import CatalogError, ConfigError

#: 1 MiB blocks: per-block bookkeeping is negligible next to the read, and a budget can skip most of a tensor.
DEFAULT_BLOCK_BYTES = 1 << 20


def iso_timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


class Catalog:
    """A MergePipe catalog: its stores share one connection and one transaction."""

    def __init__(self, db: Database, clock: Callable[[], float]) -> None:
        self._db = db
        self._clock = clock
        meta = db.meta()
        if meta is None:
            raise not_a_catalog(db.path)
        self._block_bytes = int(meta["block_bytes"])
        self.models = ModelStore(db)
        self.blocks = BlockStore(db, self.models)
        self.stats = StatisticsStore(db, self.now, self.models)
        self.plans = PlanStore(db, self.now)
        self.snapshots = SnapshotStore(db, self.now, self.models, self.blocks, self.plans)
        self.deltas = DeltaStores(db, self.now, self.stats)
        self.timings = TimingStore(db, self.now)
        self.evaluations = EvaluationStore(db, self.snapshots, self.blocks)
        self.searches = SearchStore(db)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str] | ServerURL,
        block_bytes: int | None = None,
        *,
        clock: Callable[[], float] = time.time,
        adopt_empty: bool = False,
    ) -> Catalog:
        """Create the catalog at ``path``, or open it if it exists."""
        if block_bytes is not None and (
            isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0
        ):
            raise ConfigError(f"block size must be a positive number of bytes, got {block_bytes!r}")
        path = catalog_location(path)
        if isinstance(path, Path):
            _check_file(path, block_bytes, clock, adopt_empty)
        db = Database.connect(path)
        try:
            db.initialise(block_bytes or DEFAULT_BLOCK_BYTES, iso_timestamp(clock()))
            catalog = cls(db, clock)
        except BaseException:
            db.close()
            raise
        if block_bytes is not None and catalog.block_bytes != block_bytes:
            catalog.close()
            raise CatalogError(
                f"catalog {path} already exists with block size {catalog.block_bytes} bytes, "
                f"not {block_bytes}; omit --block-bytes or use another --db path"
            )
        return catalog

    @classmethod
    def open(cls, path: str | os.PathLike[str] | ServerURL, *, clock: Callable[[], float] = time.time) -> Catalog:
        """Open an existing catalog, migrating its schema forward if needed."""
        path = catalog_location(path)
        if isinstance(path, Path) and not path.is_file():
            raise CatalogError(f"no catalog at {path}; run `mergepipe init-db --db {path}`")
        db = Database.connect(path)
        try:
            if db.meta() is None:
                if isinstance(path, ServerURL):  # an empty database: not made a catalog yet
                    raise CatalogError(f"no catalog at {path}; run `mergepipe init-db --db {path}`")
                raise not_a_catalog(path)
            db.migrate()
            return cls(db, clock)
        except BaseException:
            db.close()
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Location:
        """The catalog's file, or its server's URL (whose text never shows a password)."""
        return self._db.path

    @property
    def url(self) -> str:
        """The catalog as a SQLAlchemy URL (for Optuna's study), with any password: never print it."""
        return self._db.url

    @property
    def shared(self) -> bool:
        """Whether the catalog is a server's (PostgreSQL), which other machines may use at the same time."""
        return self._db.shared

    def refresh_statistics(self) -> None:
        """After a bulk write, the server's query planner told about the new rows."""
        self._db.refresh_statistics()

    def table_names(self) -> set[str]:
        return self._db.table_names()

    @property
    def block_bytes(self) -> int:
        """Catalog-wide block size: every model's blocks are cut at this size."""
        return self._block_bytes

    @property
    def schema_version(self) -> int:
        return self._db.schema_version()

    def now(self) -> str:
        """The injected clock as an ISO-8601 UTC timestamp."""
        return iso_timestamp(self._clock())

    @contextmanager
    def transaction(self) -> Iterator[Catalog]:
        """One write transaction over every store (nested use joins the outer one)."""
        with self._db.transaction():
            yield self

    @property
    def in_transaction(self) -> bool:
        return self._db.in_transaction

    def model_status(self, model_id: str) -> ModelStatus:
        """How far analysis of a model has got (hashed blocks, analysed bases)."""
        record = self.models.get(model_id)
        bases = tuple(a.base_id for a in self.stats.analyses(model_id) if a.expert_id == model_id)
        return ModelStatus(
            model_id=model_id,
            hashed_blocks=self.blocks.hashed_count(model_id),
            n_blocks=record.n_blocks,
            analyzed_against=bases,
        )


def _check_file(path: Path, block_bytes: int | None, clock: Callable[[], float], adopt_empty: bool) -> None:
    """Refuse what cannot be a catalog file at ``path``; create it there if nothing is."""
    if path.is_dir():
        raise CatalogError(f"{path} is a directory; give a file path for the catalog, e.g. {path}/catalog.db")
    if not path.parent.is_dir():
        raise CatalogError(f"cannot create a catalog at {path}: directory {path.parent} does not exist")
    if not path.exists():
        _create_file(path, block_bytes or DEFAULT_BLOCK_BYTES, iso_timestamp(clock()))
    elif path.is_file() and path.stat().st_size == 0 and not adopt_empty:
        raise CatalogError(
            f"{path} is an empty file, not a MergePipe catalog; run `mergepipe init-db --db {path}` to make it "
            "one, or give another --db"
        )


def _create_file(path: Path, block_bytes: int, created_at: str) -> None:
    """A complete new catalog at ``path``, unless another process linked one there first."""
    staging = path.with_name(f".{path.name}.creating-{uuid.uuid4().hex}")
    wal = staging.with_name(staging.name + "-wal")
    dialect = SQLiteDialect()
    db = Database(dialect.connect(staging), path, dialect)  # errors name the catalog being created
    try:
        db.initialise(block_bytes, created_at)
        # everything into the main file now: a checkpoint that cannot finish (a full disk) fails here
        busy, _, _ = db.query_row("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
        if busy or (wal.exists() and wal.stat().st_size):
            raise CatalogError(
                f"cannot create catalog {path}: its journal could not be written back (is the disk full?)"
            )
        os.link(staging, path)  # never replaces: the first creator wins
    except FileExistsError:
        pass  # another process created it: it is the catalog
    except OSError as exc:
        raise CatalogError(f"cannot create catalog {path}: {exc.strerror}") from None
    finally:
        db.close()
        for leftover in (staging, wal, staging.with_name(staging.name + "-shm")):
            leftover.unlink(missing_ok=True)


def _record_tables() -> tuple[str, ...]:
    """Every record table, in the order the migrations create them: parents before children."""
    statements = [s.split() for m in MIGRATIONS for s in m.statements]
    created = [s[2] for s in statements if s[:2] == ["CREATE", "TABLE"]]
    dropped = {s[2] for s in statements if s[:2] == ["DROP", "TABLE"]}
    return tuple(table for table in created if table != "meta" and table not in dropped)


TABLES = _record_tables()
#: Order within a table where a row may reference another row of the same table (a delta model its base).
_ORDER = {"models": "ORDER BY CASE WHEN delta_base IS NULL THEN 0 ELSE 1 END, id"}


def copy_catalog(
    source: Catalog, target: Catalog, progress: Callable[[str, int], None] | None = None
) -> dict[str, int]:
    """Copy every record of ``source`` into the empty ``target`` in one transaction."""
    src, dst = source._db, target._db
    if source.schema_version != target.schema_version:
        raise CatalogError(
            f"catalog {source.path} has schema version {source.schema_version} and {target.path} "
            f"{target.schema_version}; open both with the same mergepipe first"
        )
    if source.block_bytes != target.block_bytes:
        raise CatalogError(
            f"catalog {target.path} has blocks of {target.block_bytes} bytes, {source.path} of "
            f"{source.block_bytes}; export into a new catalog"
        )
    copied: dict[str, int] = {}
    with src.read_snapshot(), target.transaction():  # the source as it was at one moment, whoever writes to it
        held = {table: n for table in TABLES if (n := int(dst.query_row(f"SELECT count(*) FROM {table}")[0]))}
        if held:
            listed = ", ".join(f"{n} {table}" for table, n in held.items())
            raise CatalogError(f"catalog {target.path} is not empty ({listed}); export into a new catalog")
        (created_at,) = src.query_row("SELECT value FROM meta WHERE key = 'created_at'")
        dst.set_meta("created_at", created_at)
        for table in TABLES:
            copied[table] = 0
            for columns, rows in src.stream(f"SELECT * FROM {table} {_ORDER.get(table, '')}"):
                dst.insert_rows(table, columns, rows)
                copied[table] += len(rows)
            if progress is not None:
                progress(table, copied[table])
    return copied

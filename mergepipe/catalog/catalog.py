"""The catalog: one database that knows every model, block, statistic, plan and snapshot.

``Catalog`` is composed of small stores that share one connection and one
transaction:

* ``catalog.models``     models, files, tensors, lineage   (``models.py``)
* ``catalog.blocks``     block geometry and content hashes (``blocks.py``)
* ``catalog.stats``      (expert, base) delta statistics    (``statistics.py``)
* ``catalog.plans``      saved plans                         (``plans.py``)
* ``catalog.snapshots``  publish intents and snapshots       (``snapshots.py``)
* ``catalog.deltas``     delta stores: largest-first entries  (``deltas.py``)
* ``catalog.timings``    analysis reads, kernel probes, merges: what time was spent (``timings.py``)
* ``catalog.evaluations`` what models scored on which data (``evaluations.py``)
* ``catalog.searches`` which search study and trial a snapshot is the best of (``searches.py``)

Several processes can share one catalog file, and several machines one
PostgreSQL catalog (``postgresql://`` URL, ``postgres.py``): readers never
block, writers queue. Transactions are explicit: ``with catalog.transaction():`` opens one
(an inner one joins the outer), and no write commits on its own. The catalog
stores and returns records; it never reads checkpoints or other files
(``mergepipe.analysis`` does that).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from mergepipe.catalog.database import Database, Location, ServerURL, SQLiteDialect, catalog_location, not_a_catalog
from mergepipe.catalog.models import BlockStore, ModelStore
from mergepipe.catalog.records import ModelStatus
from mergepipe.catalog.snapshots import EvaluationStore, PlanStore, SearchStore, SnapshotStore, TimingStore
from mergepipe.catalog.statistics import DeltaStores, StatisticsStore
from mergepipe.errors import CatalogError, ConfigError

#: 1 MiB blocks: large enough that per-block bookkeeping is negligible next to
#: the read, small enough that a budget can skip most of a tensor.
DEFAULT_BLOCK_BYTES = 1 << 20


def iso_timestamp(seconds: float) -> str:
    """Epoch seconds as an ISO-8601 UTC timestamp (millisecond precision)."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


class Catalog:
    """A MergePipe catalog. Make one with ``create`` or ``open``."""

    def __init__(self, db: Database, clock: Callable[[], float]) -> None:
        self._db = db
        self._clock = clock
        meta = db.meta()
        if meta is None:
            raise not_a_catalog(db.path)
        self._block_bytes = int(meta["block_bytes"])
        self.blocks = BlockStore(db)
        self.models = ModelStore(db, self.blocks)
        self.stats = StatisticsStore(db, self.now)
        self.plans = PlanStore(db, self.now)
        self.snapshots = SnapshotStore(db, self.now, self.models, self.blocks, self.plans)
        self.deltas = DeltaStores(db, self.now, self.stats)
        self.timings = TimingStore(db, self.now)
        self.evaluations = EvaluationStore(db, self.snapshots, self.blocks)
        self.searches = SearchStore(db)

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str] | ServerURL,
        block_bytes: int | None = None,
        *,
        clock: Callable[[], float] = time.time,
        adopt_empty: bool = False,
    ) -> Catalog:
        """Create the catalog at ``path``, or open it if it already exists.

        ``block_bytes`` defaults to ``DEFAULT_BLOCK_BYTES`` for a new catalog
        and to whatever an existing one uses. Block geometry is catalog-wide,
        so an existing catalog with a different explicit value is refused.

        A new catalog is built in a hidden file beside ``path`` and linked into
        place complete, so no process ever sees a half-created one, and two
        processes creating the same catalog end up sharing one. An existing
        empty file is therefore never ours: it is refused unless
        ``adopt_empty`` (what ``init-db`` asks for). A ``postgresql://`` URL
        names a database that exists; an empty one gets the schema (processes
        racing do it once, under the write lock).
        """
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def path(self) -> Location:
        """The catalog's file, or its server's URL (whose text never shows a password): what messages and
        suggested commands name (``--db {catalog.path}``)."""
        return self._db.path

    @property
    def url(self) -> str:
        """The catalog as a SQLAlchemy URL (``sqlite:///PATH`` or ``postgresql+psycopg://...``), for a library
        keeping its own tables in the same database (Optuna's study). It carries any password: never print it."""
        return self._db.url

    @property
    def shared(self) -> bool:
        """Whether the catalog is a server's (PostgreSQL), which other machines may use at the same time."""
        return self._db.shared

    def refresh_statistics(self) -> None:
        """After a bulk write, the server's query planner told about the new rows (``Database``)."""
        self._db.refresh_statistics()

    def table_names(self) -> set[str]:
        """Every table of the catalog's database, other libraries' included (Optuna's, of `search`)."""
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

    # ---------------------------------------------------------------- transactions

    @contextmanager
    def transaction(self) -> Iterator[Catalog]:
        """One write transaction over every store (nested use joins the outer one)."""
        with self._db.transaction():
            yield self

    @property
    def in_transaction(self) -> bool:
        return self._db.in_transaction

    # ---------------------------------------------------------------- cross-store

    def model_status(self, model_id: str) -> ModelStatus:
        """How far analysis of a model has got (hashed blocks, analysed bases)."""
        record = self.models.get(model_id)
        bases = tuple(a.base_id for a in self.stats.analyses(model_id) if a.expert_id == model_id)
        return ModelStatus(model_id, self.blocks.hashed_count(model_id), record.n_blocks, bases)


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
        # everything into the main file now: a checkpoint that cannot finish
        # (a full disk) must fail here, not leave a file that needs its WAL
        busy, _, _ = db.query_row("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
        if busy or (wal.exists() and wal.stat().st_size):
            raise CatalogError(
                f"cannot create catalog {path}: its journal could not be written back (is the disk full?)"
            )
        os.link(staging, path)  # never replaces: the first creator wins
    except FileExistsError:
        pass
    except OSError as exc:
        raise CatalogError(f"cannot create catalog {path}: {exc.strerror}") from None
    finally:
        db.close()
        for leftover in (staging, wal, staging.with_name(staging.name + "-shm")):
            leftover.unlink(missing_ok=True)


#: Every record table, parents before children; ``models`` is ordered within (a delta model after its base).
TABLES = (
    "models",
    "model_parents",
    "files",
    "tensors",
    "blocks",
    "analyses",
    "block_deltas",
    "tensor_stats",
    "delta_stores",
    "delta_chunks",
    "delta_stages",
    "plans",
    "snapshots",
    "snapshot_locations",
    "snapshot_aliases",
    "output_blocks",
    "hub_locations",
    "analyze_reads",
    "kernel_probes",
    "merge_timings",
    "evaluations",
    "searches",
)
#: Order within a table where a row may reference another row of the same table.
_ORDER = {"models": "ORDER BY CASE WHEN delta_base IS NULL THEN 0 ELSE 1 END, id"}


@dataclass(frozen=True)
class Copied:
    """Rows copied per table, in ``TABLES`` order."""

    rows: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def copy_catalog(source: Catalog, target: Catalog, progress: Callable[[str, int], None] | None = None) -> Copied:
    """Copy every record of ``source`` into the empty ``target`` (see the module docstring); ``progress`` is
    told each table's name and rows as it is done."""
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
        held = {table: n for table in TABLES if (n := _count(dst, table))}
        if held:
            listed = ", ".join(f"{n} {table}" for table, n in held.items())
            raise CatalogError(f"catalog {target.path} is not empty ({listed}); export into a new catalog")
        dst.write(dst.dialect.upsert_meta, ("created_at", _created_at(src)))
        for table in TABLES:
            copied[table] = _copy_table(src, dst, table)
            if progress is not None:
                progress(table, copied[table])
    return Copied(copied)


def _count(db: Database, table: str) -> int:
    return int(db.query_row(f"SELECT count(*) FROM {table}")[0])


def _created_at(db: Database) -> str:
    return str(db.query_row("SELECT value FROM meta WHERE key = 'created_at'")[0])


def _copy_table(src: Database, dst: Database, table: str) -> int:
    count = 0
    for columns, rows in src.stream(f"SELECT * FROM {table} {_ORDER.get(table, '')}"):
        dst.insert_rows(table, columns, rows)
        count += len(rows)
    return count

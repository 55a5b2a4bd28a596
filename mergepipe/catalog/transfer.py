"""Copy a catalog into an empty one, whatever the backends (SQLite ↔ PostgreSQL).

Every record table is copied row for row, parents before children (so each
foreign key holds as the row arrives), in one write transaction of the
target: it ends up a complete copy or unchanged. The source is read in one
read-only transaction, so the tables agree with each other however others
write to a shared catalog meanwhile, and a batch of rows at a time (a
server-side cursor on PostgreSQL): memory stays that of a batch. Values go
through as the drivers read them (text, 64-bit integers, doubles, NULL), so
plan JSON, digests, hashes and timestamps are the same strings after the
copy, and a plan digest still names its plan. The target must be empty, at the same
schema version and block size; its meta keeps its own magic and schema
version and takes the source's ``created_at``. Tables the schema does not
define (another library's, such as an Optuna study's) are not copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mergepipe.catalog.catalog import Catalog
from mergepipe.catalog.database import Database
from mergepipe.errors import CatalogError

#: Every record table, parents before children; ``models`` is ordered within (a delta model after its base).
TABLES = (
    "models", "model_parents", "files", "tensors", "blocks", "analyses", "block_deltas", "tensor_stats",
    "delta_stores", "delta_chunks", "delta_stages", "plans", "snapshots", "snapshot_locations", "snapshot_aliases",
    "output_blocks", "hub_locations", "analyze_reads", "kernel_probes", "merge_timings", "evaluations", "searches",
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
        raise CatalogError(f"catalog {source.path} has schema version {source.schema_version} and {target.path} "
                           f"{target.schema_version}; open both with the same mergepipe first")
    if source.block_bytes != target.block_bytes:
        raise CatalogError(f"catalog {target.path} has blocks of {target.block_bytes} bytes, {source.path} of "
                           f"{source.block_bytes}; export into a new catalog")
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

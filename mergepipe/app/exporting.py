"""`mergepipe catalog export`: copy a catalog into a new one, across backends (``catalog/transfer.py``).

How one machine's catalog becomes a team's: ``--db catalog.db --to
postgresql://...`` copies every model, analysis, plan and snapshot record, so
nothing is registered or analysed again (the files stay where they are: on
another machine they must be reachable under the same paths). The reverse
takes a team's catalog to a laptop. The source is only read; the target is
created (a file) or given the schema (an empty database), then filled in one
transaction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.location import Location, ServerURL, catalog_location
from mergepipe.catalog.transfer import copy_catalog
from mergepipe.errors import CatalogError


@dataclass(frozen=True)
class Exported:
    """What was copied: rows per table, from where to where."""

    source: Location
    target: Location
    rows: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def export_catalog(db: Catalogish, to: str | os.PathLike[str] | ServerURL, *,
                   reporter: Reporter = SILENT) -> Exported:
    """Copy the catalog ``db`` into ``to``, a new file or an empty PostgreSQL database (module docstring)."""
    target_location = catalog_location(to)
    with open_catalog(db, reporter=reporter) as source:
        if str(target_location) == str(source.path):
            raise CatalogError(f"--to {target_location} is the catalog being exported; give another one")
        with Catalog.create(target_location, source.block_bytes) as target:
            copied = copy_catalog(source, target, lambda table, n: reporter.note(f"  {table}: {n} rows"))
        return Exported(source.path, target_location, copied.rows)

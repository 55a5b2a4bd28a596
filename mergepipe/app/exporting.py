"""`mergepipe catalog export`: copy a catalog into a new one, across backends (``catalog/transfer.py``).

How one machine's catalog becomes a team's: ``--db catalog.db --to
postgresql://...`` copies every model, analysis, plan and snapshot record, so
nothing is registered or analysed again (the files stay where they are: on
another machine they must be reachable under the same paths). The reverse
takes a team's catalog to a laptop. The source is only read; the target is
created (a file) or given the schema (an empty database), then filled in one
transaction. The studies of `search`, which Optuna keeps in its own tables of
the same database, are copied after, by Optuna (``copy_study``), so a copied
catalog's searches can be resumed there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.location import Location, ServerURL, catalog_location
from mergepipe.catalog.transfer import copy_catalog
from mergepipe.txn.outpath import refuse_inside_models
from mergepipe.txn.publish import resolve_output

#: The table that says Optuna's schema is in a database (`search` keeps its studies there).
OPTUNA_TABLE = "studies"


@dataclass(frozen=True)
class Exported:
    """What was copied: rows per table and the search studies, from where to where."""

    source: Location
    target: Location
    rows: dict[str, int]
    studies: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def export_catalog(db: Catalogish, to: str | os.PathLike[str] | ServerURL, *,
                   reporter: Reporter = SILENT) -> Exported:
    """Copy the catalog ``db`` into ``to``, a new file or an empty PostgreSQL database (module docstring)."""
    target_location = catalog_location(to)
    with open_catalog(db, reporter=reporter) as source:
        if isinstance(target_location, Path):  # never over the source, nor in one of its models or snapshots
            refuse_inside_models(source, resolve_output(target_location), option="--to")
        with Catalog.create(target_location, source.block_bytes) as target:
            copied = copy_catalog(source, target, lambda table, n: reporter.note(f"  {table}: {n} rows"))
            studies = _copy_studies(source, target, reporter)
        return Exported(source.path, target_location, copied.rows, studies)


def _copy_studies(source: Catalog, target: Catalog, reporter: Reporter) -> tuple[str, ...]:
    """Copy the source's Optuna studies (none unless `search` ran on it) into the target's database."""
    if OPTUNA_TABLE not in source.table_names():
        return ()  # never open Optuna's storage on a catalog without it: that would create its tables
    try:
        optuna = import_module("optuna")
    except ImportError:
        reporter.warning(f"warning: {source.path} holds search studies, which need Optuna to copy "
                         "(pip install 'mergepipe[search]'); they were not copied")
        return ()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = tuple(sorted(optuna.study.get_all_study_names(storage=source.url)))
    for name in names:
        optuna.copy_study(from_study_name=name, from_storage=source.url, to_storage=target.url)
        reporter.note(f"  search study {name}: copied")
    return names

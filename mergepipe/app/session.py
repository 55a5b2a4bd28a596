"""What every application call shares: the catalog it works on, and how it tells the user what happens.

``Catalogish`` is a path or an open ``Catalog``: Python users pass either,
the command line passes ``--db``. A call that writes opens it with
``writing`` and first finishes or rolls back whatever an interrupted publish
left (``txn/recover.py``), so a crash never blocks the next command; a call
that only reads opens an existing catalog and changes nothing.

``Reporter`` is how a long call says what it is doing while it does it (the
plan before executing it, a model analysed on the way, a note on a mergekit
translation): the command line prints it, Python callers get a silent one
by default or pass their own. Results are returned, not printed.

Recovery (and all it imports: manifests, provenance) is loaded only when a
call writes, so the read-only views start fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.catalog import Catalog

if TYPE_CHECKING:
    from mergepipe.spec.plan import Plan
    from mergepipe.txn.recover import RecoverReport

#: A catalog file's path, or a catalog already open (then it is neither recovered again nor closed).
Catalogish = str | os.PathLike[str] | Catalog


class Reporter:
    """Receives what a call wants the user to know while it runs; this one ignores everything."""

    def note(self, text: str) -> None:
        """A line of information (a model registered or analysed on the way, a translation note)."""

    def warning(self, text: str) -> None:
        """A line the user should not miss (the output equals the base, an unmerged tensor differs)."""

    def planned(self, plan: Plan) -> None:
        """The plan a merge is about to execute."""

    def recovered(self, report: RecoverReport) -> None:
        """What recovery finished or rolled back before the call wrote anything."""


SILENT = Reporter()


@contextmanager
def open_catalog(db: Catalogish, *, writing: bool = False, out: str | os.PathLike[str] | None = None,
                 block_bytes: int | None = None, reporter: Reporter = SILENT) -> Iterator[Catalog]:
    """The catalog ``db`` names. ``writing``: created if missing (with ``block_bytes`` if given) and
    recovered first, also beside ``out`` where a publish killed before its intent left its staging
    directory; otherwise it must exist."""
    if isinstance(db, Catalog):
        yield db
        return
    catalog = Catalog.create(db, block_bytes) if writing else Catalog.open(db)  # create: safe when two race
    with catalog:
        if writing:
            recover = import_module("mergepipe.txn.recover").recover
            report = recover(catalog, also_scan=[] if out is None else [Path(os.path.abspath(out)).parent])
            if report.changed:
                reporter.recovered(report)
        yield catalog

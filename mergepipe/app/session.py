"""What every application call shares: the catalog (a path, a URL, an open ``Catalog``, or None: the
default) and the ``Reporter``; a call that writes recovers interrupted publishes first."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.catalog import Catalog
from mergepipe.catalog.database import Location, ServerURL, catalog_location
from mergepipe.errors import CatalogError

if TYPE_CHECKING:
    from mergepipe.spec.plan import Plan
    from mergepipe.txn.recover import RecoverReport

#: A catalog file's path or a ``postgresql://`` URL, a catalog already open (then neither recovered again nor
#: closed), or None: the default catalog.
Catalogish = str | os.PathLike[str] | ServerURL | Catalog | None
#: The environment variable naming the catalog to use when none is given.
CATALOG_ENV = "MERGEPIPE_DB"


@dataclass(frozen=True)
class DefaultCatalog:
    """The catalog used when none is given, and whether ``$MERGEPIPE_DB`` named it (else it is the per-user one)."""

    path: Location
    from_env: bool

    def line(self) -> str:
        """The line that names it where it is used (stderr), and how to choose another."""
        why = f"from ${CATALOG_ENV}" if self.from_env else f"the default; --db or {CATALOG_ENV} to choose"
        return f"catalog: {self.path} ({why})"


def default_catalog() -> DefaultCatalog:
    """``$MERGEPIPE_DB`` if set, else ``mergepipe/catalog.db`` in platformdirs' per-user data directory."""
    named = os.environ.get(CATALOG_ENV, "").strip()
    if named:
        found = catalog_location(named)
        return DefaultCatalog(found.expanduser() if isinstance(found, Path) else found, from_env=True)
    xdg = os.environ.get("XDG_DATA_HOME", "")
    local = os.environ.get("LOCALAPPDATA")
    if sys.platform == "win32":
        root = Path(local) if local else Path.home() / "AppData" / "Local"
    elif sys.platform == "darwin":
        root = Path.home() / "Library" / "Application Support"
    else:
        root = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return DefaultCatalog(root / "mergepipe" / "catalog.db", from_env=False)


def prepare_catalog_dir(path: Location) -> None:
    """Refuse a catalog inside a snapshot; create the default catalog's folder (any other must exist)."""
    if isinstance(path, Path):
        outpath = import_module("mergepipe.txn.outpath")
        outpath.refuse_inside_models(None, outpath.resolve_output(path), option="--db")
    found = default_catalog()
    if not isinstance(path, Path) or found.from_env or path != found.path or path.parent.is_dir():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CatalogError(
            f"cannot create {path.parent} for the default catalog ({exc.strerror}); give --db or set {CATALOG_ENV}"
        ) from None


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
def open_catalog(
    db: Catalogish,
    *,
    writing: bool = False,
    out: str | os.PathLike[str] | None = None,
    block_bytes: int | None = None,
    reporter: Reporter = SILENT,
) -> Iterator[Catalog]:
    """The catalog ``db`` names; ``writing``: created if missing and recovered first (also beside ``out``)."""
    if isinstance(db, Catalog):
        yield db
        return
    if db is None:
        found = default_catalog()
        reporter.note(found.line())
        db = found.path
    where = catalog_location(db)
    if writing:
        prepare_catalog_dir(where)
    catalog = Catalog.create(where, block_bytes) if writing else Catalog.open(where)  # create: safe when two race
    with catalog:
        if writing:
            recover = import_module("mergepipe.txn.recover").recover
            report = recover(catalog, also_scan=[] if out is None else [Path(os.path.abspath(out)).parent])
            if report.changed:
                reporter.recovered(report)
        yield catalog

"""What every application call shares: the catalog it works on, and how it tells the user what happens.

``Catalogish`` is a path, a ``postgresql://`` URL (a catalog several machines
share) or an open ``Catalog``: Python users pass any,
the command line passes ``--db``; None is the default catalog
(``default_catalog``: ``$MERGEPIPE_DB``, else a per-user catalog in the
platform's data directory, whose folder is created when first written to), so
that a first merge needs no catalog chosen. A call that writes opens it with
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
import sys
from collections.abc import Iterator, Mapping
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

#: A catalog file's path or a ``postgresql://`` URL (a string or a ``ServerURL``), a catalog already open (then
#: it is neither recovered again nor closed), or None: the default catalog (``default_catalog``).
Catalogish = str | os.PathLike[str] | ServerURL | Catalog | None
#: The environment variable naming the catalog to use when none is given.
CATALOG_ENV = "MERGEPIPE_DB"
#: The default catalog's folder and file name inside the platform's per-user data directory.
CATALOG_DIRNAME, CATALOG_FILENAME = "mergepipe", "catalog.db"


@dataclass(frozen=True)
class DefaultCatalog:
    """The catalog used when none is given, and whether ``$MERGEPIPE_DB`` named it (else it is the
    per-user one)."""

    path: Location
    from_env: bool

    def line(self) -> str:
        """The line that names it where it is used (stderr), and how to choose another."""
        why = f"from ${CATALOG_ENV}" if self.from_env else f"the default; --db or {CATALOG_ENV} to choose"
        return f"catalog: {self.path} ({why})"


def default_catalog(environ: Mapping[str, str] | None = None, platform: str | None = None) -> DefaultCatalog:
    """``$MERGEPIPE_DB`` if set, else ``catalog.db`` in ``mergepipe/`` of the per-user data directory:
    ``$XDG_DATA_HOME`` (default ``~/.local/share``) on Linux and other Unixes, ``~/Library/Application
    Support`` on macOS, ``%LOCALAPPDATA%`` on Windows. ``environ`` and ``platform`` default to this
    process's."""
    env = os.environ if environ is None else environ
    named = env.get(CATALOG_ENV, "").strip()
    if named:
        found = catalog_location(named)
        return DefaultCatalog(found.expanduser() if isinstance(found, Path) else found, from_env=True)
    return DefaultCatalog(
        user_data_dir(env, platform or sys.platform) / CATALOG_DIRNAME / CATALOG_FILENAME, from_env=False
    )


def user_data_dir(environ: Mapping[str, str], platform: str) -> Path:
    """The platform's per-user data directory (what platformdirs' ``user_data_dir`` gives, without the
    dependency); a relative ``XDG_DATA_HOME`` is ignored, as the XDG specification says."""
    if platform == "win32":
        local = environ.get("LOCALAPPDATA")
        return Path(local) if local else Path.home() / "AppData" / "Local"
    if platform == "darwin":
        return Path.home() / "Library" / "Application Support"
    xdg = environ.get("XDG_DATA_HOME", "")
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"


def prepare_catalog_dir(path: Location) -> None:
    """Before the catalog file ``path`` is written: refused inside a snapshot (``txn/outpath.py``); the folder
    of the per-user default catalog created, since that folder is MergePipe's own. Any other catalog must be
    in a folder that exists (a mistyped --db is refused, not created); a server catalog has none."""
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
    """The catalog ``db`` names (None: the default one, named through ``reporter``). ``writing``: created
    if missing (with ``block_bytes`` if given) and recovered first, also beside ``out`` where a publish
    killed before its intent left its staging directory; otherwise it must exist."""
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

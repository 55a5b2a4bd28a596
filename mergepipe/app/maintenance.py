"""`gc`, `recover`, `rm` and `catalog export`: clearing what interrupted work left, deleting the snapshot
directories a user no longer wants (only files provably published), copying a catalog with its studies."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path, PurePosixPath

from mergepipe.analysis.deltastore import sweep_abandoned
from mergepipe.analysis.register import drop as drop_versions
from mergepipe.analysis.register import droppable
from mergepipe.app.views import find_snapshot, label, restore_advice, snapshot_label
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.catalog import copy_catalog
from mergepipe.catalog.database import Location, ServerURL, catalog_location
from mergepipe.catalog.records import LocationRecord, ModelRecord, SnapshotRecord
from mergepipe.errors import ConfigError, PublishError, VerifyError
from mergepipe.manifest.manifest import as_written, derived_files, read_text
from mergepipe.manifest.manifest import MANIFEST_FILENAME, FileEntry, Manifest, read_manifest
from mergepipe.spec.plan import Plan
from mergepipe.storage.source import file_digest
from mergepipe.txn.outpath import refuse_inside_models
from mergepipe.txn.publish import MARKER, fsync_path, remove_staging, resolve_output
from mergepipe.txn.recover import RecoverReport
from mergepipe.txn.recover import recover as recover_publishes
from mergepipe.txn.verify import stamp


@dataclass
class Collected:
    removed_dirs: list[Path] = field(default_factory=list)  # aborted staging directories
    swept: list[Path] = field(default_factory=list)  # killed delta-store builds' staging files
    saved_plans: int = 0  # plans no merge ran: deleted with ``plans``, else kept
    plans_deleted: bool = False
    old_versions: list[ModelRecord] = field(default_factory=list)  # listed (``versions``)
    dropped: list[ModelRecord] = field(default_factory=list)  # and dropped (``drop``)
    store_files: list[Path] = field(default_factory=list)  # delta-store files of dropped versions
    problems: list[str] = field(default_factory=list)


def recover(db: Catalogish) -> RecoverReport:
    """Finish or roll back interrupted publishes (idempotent)."""
    with open_catalog(db) as catalog:
        return recover_publishes(catalog)


def gc(db: Catalogish, *, versions: bool = False, drop: bool = False, plans: bool = False) -> Collected:
    """Recover, then remove aborted staging and killed delta-store builds; more with ``plans``, ``versions``."""
    if drop and not versions:
        raise ConfigError("--yes only confirms --versions; nothing else gc does needs confirming")
    done = Collected()
    with open_catalog(db) as catalog:
        report = recover_publishes(catalog)  # first: a merge that died no longer holds its inputs
        done.removed_dirs, done.problems = list(report.removed), list(report.problems)
        if versions:
            done.old_versions = droppable(catalog)
            if drop and done.old_versions:
                done.dropped, done.store_files = drop_versions(catalog, done.old_versions)
        for record in catalog.snapshots.list():
            staging = Path(record.staging_path)
            if record.status != "aborted" or not os.path.lexists(staging):
                continue
            problem = remove_staging(staging, record.intent_id, Path(record.out_path))
            if problem is None:
                done.removed_dirs.append(staging)
            else:
                done.problems.append(problem)
        done.plans_deleted = plans
        done.saved_plans = catalog.plans.delete_unreferenced() if plans else catalog.plans.count_unreferenced()
        store_dirs = sorted({Path(path).parent for path in catalog.deltas.paths()})
    for directory in store_dirs:  # where this catalog's delta stores live: a killed build's staging files
        done.swept.extend(sweep_abandoned(directory) if directory.is_dir() else ())
    return done


@dataclass(frozen=True)
class RemovedLocation:
    path: Path
    was_there: bool  # False: it was gone already, and only the catalog learnt it
    kept: tuple[str, ...] = ()  # what MergePipe did not write there: left in place, with the folder


@dataclass(frozen=True)
class Removed:
    """What ``remove`` did; the snapshot stays in the catalog."""

    snapshot_id: str
    model: str  # the snapshot's model as people name that version (``merged@2``)
    locations: list[RemovedLocation]
    remaining: list[str]
    advice: str


def remove(db: Catalogish, target: str | os.PathLike[str]) -> Removed:
    """Delete a snapshot's directories (one of them, or every one of a snapshot or merged model), all checked first."""
    with open_catalog(db) as catalog:
        recover_publishes(catalog)  # a publish a crash left half done is finished or rolled back first
        record, locations = _removal(catalog, os.fspath(target))
        snapshot_id = str(record.id)
        _refuse_in_use(catalog, record)
        shown = _published_as(catalog, record, locations)
        checked = [
            (Path(loc.path), _own_manifest(Path(loc.path), snapshot_id) if os.path.lexists(loc.path) else None)
            for loc in locations
        ]
        done = []
        for path, manifest in checked:  # each marked as soon as it is gone: a failure later leaves true records
            stamps = catalog.snapshots.stamps(snapshot_id, path)
            kept = () if manifest is None else _delete_snapshot_dir(path, manifest, stamps)
            catalog.snapshots.mark_removed(snapshot_id, str(path))
            done.append(RemovedLocation(path, manifest is not None, kept))
        remaining = [loc.path for loc in catalog.snapshots.locations(snapshot_id) if loc.removed_at is None]
        return Removed(snapshot_id, shown, done, remaining, restore_advice(catalog, record))


def _removal(catalog: Catalog, target: str) -> tuple[SnapshotRecord, list[LocationRecord]]:
    """The committed snapshot ``target`` names and the locations of it to remove."""
    if os.path.lexists(target):
        return _by_directory(catalog, target)
    record, model = find_snapshot(catalog, target)
    if model is not None and model.kind != "snapshot":
        raise ConfigError(
            f"'{label(catalog, model)}' is a registered {model.kind} (your files at {model.uri}), "
            "not a snapshot MergePipe published: `mergepipe rm` never deletes them"
        )
    if record is None:
        raise ConfigError(
            f"'{model.label}' has no committed snapshot of its own; `mergepipe snapshots` lists them"
            if model is not None
            else f"{target}: no such directory, and no snapshot or merged model of {catalog.path} has that name; "
            "`mergepipe snapshots` lists them"
        )
    if record.status == "pending":
        raise PublishError(
            f"snapshot intent {record.intent_id} (model '{record.model_id}') is being published by "
            "another process; wait for it to finish, or run `mergepipe recover` if it stopped"
        )
    if record.status != "committed" or record.id is None:
        raise ConfigError(
            f"publish intent {record.intent_id} (model '{record.model_id}') was aborted: nothing of "
            "it was published (`mergepipe gc` removes what it left)"
        )
    live = [loc for loc in catalog.snapshots.locations(record.id) if loc.removed_at is None]
    if model is not None:  # an alias's directories are the alias's, the snapshot's own model's are its own
        live = [loc for loc in live if catalog.snapshots.model_at(record.id, loc.path) == model.id]
    return record, live


def _published_as(catalog: Catalog, record: SnapshotRecord, locations: list[LocationRecord]) -> str:
    """The model the removed directories publish, as people name it (``merged@2``, or an alias)."""
    models = {catalog.snapshots.model_at(str(record.id), loc.path) for loc in locations}
    alias = models.pop() if len(models) == 1 else None
    found = None if alias is None or alias == record.model_id else catalog.models.find(alias)
    return snapshot_label(catalog, record) if found is None else label(catalog, found)


def _by_directory(catalog: Catalog, target: str) -> tuple[SnapshotRecord, list[LocationRecord]]:
    """The snapshot whose live location is the directory ``target`` (as the filesystem resolves it)."""
    path = resolve_output(target)
    live = [
        loc
        for loc in catalog.snapshots.location_intents("committed")
        if Path(loc.path) == path and loc.removed_at is None
    ]
    if not live:
        raise ConfigError(_not_a_snapshot(catalog, path))
    return catalog.snapshots.get(live[0].snapshot_id), live[:1]


def _not_a_snapshot(catalog: Catalog, path: Path) -> str:
    """Why ``path`` is refused, for the one-line error: what the catalog knows of it, if anything."""
    nothing = "mergepipe rm deletes only directories of snapshots MergePipe published, and nothing was removed"
    for model in catalog.models.list():
        if model.kind != "snapshot" and Path(model.uri) == path:
            return (
                f"{path} is the directory of registered model '{label(catalog, model)}' (a {model.kind} you "
                "registered), "
                f"not a snapshot: {nothing}"
            )
    for loc in catalog.snapshots.location_intents("committed"):
        if loc.removed_at is None and Path(loc.path) in path.parents:
            return f"{path} is inside the directory of snapshot {loc.snapshot_id}: give {loc.path} to remove it"
        if loc.removed_at is not None and Path(loc.path) == path:
            return (
                f"{path} was the directory of snapshot {loc.snapshot_id}, removed with `mergepipe rm` "
                f"({loc.removed_at}); what is there now is not MergePipe's: {nothing}"
            )
    return f"{path} is not the directory of a snapshot of catalog {catalog.path} (`mergepipe snapshots`): {nothing}"


def _refuse_in_use(catalog: Catalog, record: SnapshotRecord) -> None:
    """PublishError if a merge in progress reads the snapshot (``--from``): its blocks are copied from it."""
    for pending in catalog.snapshots.pending():
        reuse = Plan.from_json(catalog.plans.get(pending.plan_id)).reuse
        if reuse is not None and reuse.snapshot == record.model_id:
            raise PublishError(
                f"a merge in progress (into '{pending.model_id}', intent {pending.intent_id}) reads "
                f"snapshot {record.id} (--from); wait for it to finish, or run `mergepipe recover` if "
                "it stopped, then remove it"
            )


def _own_manifest(path: Path, snapshot_id: str) -> Manifest:
    """The manifest in ``path``, which must be snapshot ``snapshot_id``'s: nothing else is ever deleted."""
    refused = "it is not the snapshot the catalog recorded there, and nothing was removed"
    real = Path(os.path.realpath(path))  # recorded resolved: a link now, there or above, leads to another folder
    if real != path or not path.is_dir():
        now = f"reached through a symbolic link ({real})" if real != path else "not a directory"
        raise ConfigError(f"{path}, a directory of snapshot {snapshot_id}, is {now} now: {refused}")
    try:
        manifest, _ = read_manifest(path)
    except VerifyError as exc:
        raise ConfigError(f"{path} holds no readable manifest of snapshot {snapshot_id} ({exc}): {refused}") from None
    if manifest.snapshot_id != snapshot_id:
        raise ConfigError(f"{path} holds the manifest of snapshot {manifest.snapshot_id}, not {snapshot_id}: {refused}")
    return manifest


def _delete_snapshot_dir(root: Path, manifest: Manifest, stamps: Mapping[str, tuple[int, ...]]) -> tuple[str, ...]:
    """Delete what MergePipe wrote into ``root``, the manifest last; return what is left (the user's)."""
    listed = {entry.name: entry for entry in manifest.files if _inside(entry.name)}
    derived = derived_files(manifest)
    folders = sorted(
        {root, *(parent for name in listed for parent in (root / name).parents if root in parent.parents)},
        key=lambda p: len(p.parts),
    )
    try:
        for folder in folders:  # a snapshot published by an older MergePipe has read-only folders
            mode = stat.S_IMODE(os.stat(folder).st_mode)
            if folder.is_dir() and not folder.is_symlink() and mode & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(folder, mode | stat.S_IRWXU)
        for name, entry in listed.items():
            if _is(root / name, entry, stamps.get(name)):
                (root / name).unlink()
        for name, text in derived.items():
            path = root / name
            if path.is_file() and not path.is_symlink() and as_written(manifest, read_text(path), text):
                path.unlink()
        for name in (MARKER, MANIFEST_FILENAME):
            if (root / name).is_file():
                (root / name).unlink()
        for folder in reversed(folders):
            try:
                os.rmdir(folder)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
    except OSError as exc:
        raise PublishError(
            f"cannot remove {exc.filename or root}: {exc.strerror}; what is left of the snapshot at "
            f"{root} is incomplete: fix that and run `mergepipe rm` again"
        ) from None
    fsync_path(root.parent)
    return _left_in(root) if os.path.lexists(root) else ()


def _left_in(root: Path) -> tuple[str, ...]:
    """Every file (or link) under ``root``, relative, sorted."""
    left = []
    for dirpath, dirnames, filenames in os.walk(root):
        links = [d for d in dirnames if Path(dirpath, d).is_symlink()]
        left += [Path(dirpath, name).relative_to(root).as_posix() for name in filenames + links]
    return tuple(sorted(left))


def _is(path: Path, entry: FileEntry, published: tuple[int, ...] | None) -> bool:
    """Whether ``path`` is provably the file the manifest lists (its published stamp, else its hash)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(found.st_mode) or found.st_size != entry.size:
        return False
    return stamp(found) == published or file_digest(path, entry.algorithm) == entry.digest


def _inside(name: str) -> bool:
    """A manifest's file name that stays inside the snapshot's folder (relative, no ``..``)."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts


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


def export_catalog(db: Catalogish, to: str | os.PathLike[str] | ServerURL, *, reporter: Reporter = SILENT) -> Exported:
    """Copy the catalog ``db`` into ``to``, a new file or an empty PostgreSQL database."""
    target_location = catalog_location(to)
    with open_catalog(db, reporter=reporter) as source:
        if isinstance(target_location, Path):  # never over the source, nor in one of its models or snapshots
            refuse_inside_models(source, resolve_output(target_location), option="--to")
        with Catalog.create(target_location, source.block_bytes) as target:
            copied = copy_catalog(source, target, lambda table, n: reporter.note(f"  {table}: {n} rows"))
            studies = _copy_studies(source, target, reporter)
        return Exported(source.path, target_location, copied, studies)


def _copy_studies(source: Catalog, target: Catalog, reporter: Reporter) -> tuple[str, ...]:
    """Copy the source's Optuna studies (none unless `search` ran on it) into the target's database."""
    if OPTUNA_TABLE not in source.table_names():
        return ()  # never open Optuna's storage on a catalog without it: that would create its tables
    try:
        optuna = import_module("optuna")
    except ImportError:
        reporter.warning(
            f"warning: {source.path} holds search studies, which need Optuna to copy "
            "(pip install 'mergepipe[search]'); they were not copied"
        )
        return ()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = tuple(sorted(optuna.study.get_all_study_names(storage=source.url)))
    for name in names:
        optuna.copy_study(from_study_name=name, from_storage=source.url, to_storage=target.url)
        reporter.note(f"  search study {name}: copied")
    return names

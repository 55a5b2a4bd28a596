"""Where a command may write (every output goes through here): never over its catalog, never inside a
registered model or a snapshot; a command's own file (an HTML report) is replaced only with ``--force``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection
from pathlib import Path

from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError, OutputExistsError, VerifyError
from mergepipe.manifest.manifest import MANIFEST_FILENAME, read_manifest
from mergepipe.txn.publish import resolve_output


def writable_file(catalog: Catalog, path: str | Path, force: bool, option: str) -> Path:
    """The resolved path of a file a command writes (``option``: the flag that gave it), refused where
    ``refuse_inside_models`` refuses, where something other than a file is, and where a file is unless ``force``."""
    out = resolve_output(path)
    refuse_inside_models(catalog, out, may_restore=(), option=option)
    if os.path.lexists(out):
        if not os.path.isfile(out):
            raise ConfigError(f"{option} {out} exists and is not a file; give the path of a file to write")
        if not force:
            raise OutputExistsError(
                f"{option} {out} already exists; add --force to overwrite it, or choose another path"
            )
    return out


def refuse_inside_models(
    catalog: Catalog | None,
    out_path: Path,
    may_restore: Collection[str] | None = None,
    option: str = "--out",
    replacing: bool = False,
) -> None:
    """ConfigError if ``out_path`` (resolved) is ``catalog``'s file (or its ``-wal``, ``-shm``, ``-journal``), or
    is inside a registered model or a snapshot's directory (``catalog`` None: only the manifests on the way are
    asked). It may be exactly a deleted location of a snapshot in ``may_restore`` (any when None), which
    re-materialising puts back; with ``replacing`` (``mergepipe-yaml``), exactly any snapshot's directory."""
    if catalog is not None:
        _refuse_in_catalog(catalog, out_path, may_restore, option, replacing)
    for folder in out_path.parents:  # a snapshot no record knows: of another catalog, or before a catalog exists
        if (folder / MANIFEST_FILENAME).is_file():
            try:
                found = read_manifest(folder)[0].snapshot_id
            except VerifyError:
                continue
            raise ConfigError(
                f"output path {out_path} is inside snapshot {found} ({folder}); MergePipe never "
                f"writes into a registered model or snapshot: choose a {option} outside it"
            )


def _refuse_in_catalog(
    catalog: Catalog, out_path: Path, may_restore: Collection[str] | None, option: str, replacing: bool
) -> None:
    if isinstance(catalog.path, Path):
        own = resolve_output(catalog.path)
        if out_path in (own, *(own.with_name(own.name + end) for end in ("-wal", "-shm", "-journal"))):
            raise ConfigError(
                f"output path {out_path} is the catalog {catalog.path} or one of its files; MergePipe "
                f"never writes over its catalog, whatever --force says: choose another {option}"
            )
    snapshots = catalog.snapshots
    gone = {
        Path(loc.path)
        for loc in snapshots.location_intents("committed")
        if (may_restore is None or loc.snapshot_id in may_restore) and not os.path.lexists(loc.path)
    }
    owners = [(f"model '{m.id}'", Path(m.uri), m.kind == "snapshot") for m in catalog.models.list()]
    owners += [
        (f"the output of merge intent {s.intent_id}", Path(s.out_path), s.status == "committed")
        for s in snapshots.list()
        if s.status != "aborted"
    ]
    owners += [
        (f"a location of snapshot {loc.snapshot_id}", Path(loc.path), loc.status == "committed")
        for loc in snapshots.location_intents()
        if loc.status != "aborted"
    ]
    for s in snapshots.pending():
        if out_path == Path(s.out_path):
            raise ConfigError(
                f"output path {out_path} is being published by another merge, in progress since {s.created_at} "
                f"(model '{s.model_id}', intent {s.intent_id[:12]}); wait for it to finish, or run "
                "`mergepipe recover` if it stopped"
            )
    for owner, directory, committed in owners:
        if committed and out_path == directory and (replacing or directory in gone):
            continue
        if committed and out_path == directory and not os.path.lexists(directory):  # a deleted snapshot
            raise ConfigError(
                f"output path {out_path} is where the catalog records {owner}, deleted since: only the same "
                f"snapshot may be re-materialised there (by executing its plan again); choose another {option}"
            )
        if out_path == directory or directory in out_path.parents:
            raise ConfigError(
                f"output path {out_path} is inside {owner} ({directory}); MergePipe never writes into a "
                f"registered model or snapshot: choose a {option} outside it"
            )


def write_report(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (checked by ``writable_file``) atomically: a temporary file beside it,
    fsynced, then renamed over it. A path that cannot be written is a one-line ConfigError."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot write the report there ({exc.strerror}); give a path in an existing, writable directory"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(
            f"{path}: cannot write the report ({exc.strerror}); give a writable file path (not a directory)"
        ) from None

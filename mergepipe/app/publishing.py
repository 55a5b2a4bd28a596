"""`push`: a published snapshot onto the Hugging Face Hub as one commit, once its files verify, recorded as one
of its locations (``hf://ORG/NAME@SHA``)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pydantic import field_validator

from mergepipe.app.views import find_snapshot, restore_advice
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import HubPush, SnapshotRecord
from mergepipe.errors import CatalogError, ConfigError, PublishError, PushError, VerifyError
from mergepipe.manifest.manifest import read_manifest
from mergepipe.spec.request import StrictModel
from mergepipe.storage.location import HUB_COMMIT, hub_location
from mergepipe.txn.publish import check_online, commit_files
from mergepipe.txn.verify import VerifyReport, verify_snapshot


class HubTarget(StrictModel):
    """Where a snapshot is pushed: ``repo_id`` (created ``private`` if missing), on branch ``revision``."""

    what: ClassVar[str] = "Hub target"

    repo_id: str
    private: bool = False
    revision: str | None = None

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, value: str) -> str:
        try:
            hub = hub_location(value if value.startswith("hf://") else f"hf://{value}")
        except ConfigError:
            hub = None
        if hub is None or hub.revision is not None or hub.path:
            raise ValueError(
                "give the Hub repository as org/name (letters, digits and . _ -), the branch with --revision"
            )
        return hub.repo_id

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value != value.strip() or HUB_COMMIT.match(value)):
            raise ValueError("--revision names the branch to push to (a commit cannot be pushed to)")
        return value

    def retry(self, catalog: Catalog, snapshot_id: str) -> str:
        """The command that pushes ``snapshot_id`` here again."""
        flags = (" --private" if self.private else "") + (
            "" if self.revision is None else f" --revision {shlex.quote(self.revision)}"
        )
        return f"mergepipe push {snapshot_id} {self.repo_id} --db {shlex.quote(str(catalog.path))}{flags}"


@dataclass(frozen=True)
class Pushed:
    """What a push did; ``created``: False when the branch held these files already."""

    snapshot_id: str
    model_id: str
    path: Path
    location: HubPush
    files: tuple[str, ...]
    total_bytes: int
    created: bool = True
    deleted: tuple[str, ...] = ()


def push(
    db: Catalogish,
    target: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    reporter: Reporter = SILENT,
) -> Pushed:
    """Push the snapshot ``target`` names to Hub repository ``repo_id`` as one commit."""
    hub = HubTarget(repo_id=repo_id, private=private, revision=revision)
    check_online()
    with open_catalog(db, reporter=reporter) as catalog:  # it must exist: it has the snapshot
        record, path = _snapshot_at(catalog, target)
        return push_snapshot(catalog, record, path, hub)


def push_snapshot(catalog: Catalog, record: SnapshotRecord, path: Path, hub: HubTarget) -> Pushed:
    """Verify the snapshot ``record`` at ``path``, commit its files to ``hub``, record the commit."""
    snapshot_id = str(record.id)
    report = _verified(record, path)
    files = {name: path / name for name in report.checked}
    total = sum(f.stat().st_size for f in files.values())
    model_id = report.manifest.model_id if report.manifest is not None else record.model_id
    retry = hub.retry(catalog, snapshot_id)
    try:
        made = commit_files(
            hub.repo_id,
            files,
            message=f"MergePipe snapshot {snapshot_id[:12]} of {model_id}",
            description=(
                f"Snapshot {snapshot_id} (manifest hash {record.manifest_hash}), published by MergePipe. "
                "`mergepipe verify` checks a download of it (the folder `hf download` prints)."
            ),
            private=hub.private,
            revision=hub.revision,
        )
    except PublishError as exc:
        raise PushError(
            f"pushing snapshot {snapshot_id} to {hub.repo_id} failed: {exc}; no commit was made "
            f"there and the local snapshot at {path} is intact; retry with `{retry}`"
        ) from None
    except KeyboardInterrupt:
        raise PushError(
            f"interrupted while pushing snapshot {snapshot_id} to {hub.repo_id}: the Hub commit is "
            f"all or nothing, and the local snapshot at {path} is intact; retry with `{retry}`",
            interrupted=True,
        ) from None
    location = catalog.snapshots.add_hub_location(snapshot_id, hub.repo_id, made.revision, made.commit, made.private)
    return Pushed(snapshot_id, model_id, path, location, tuple(files), total, made.created, made.deleted)


def _snapshot_at(catalog: Catalog, target: str | os.PathLike[str]) -> tuple[SnapshotRecord, Path]:
    """The committed snapshot ``target`` names and a directory holding it (``target``, or a live copy)."""
    path = Path(target)
    if path.is_dir():
        manifest, _ = read_manifest(path)  # checked with every file by push_snapshot
        record = catalog.snapshots.find(manifest.snapshot_id)
        if record is None or record.status != "committed":
            raise CatalogError(
                f"{path} holds snapshot {manifest.snapshot_id}, which catalog {catalog.path} "
                "does not have; give the --db of the catalog that published it"
            )
        return record, Path(os.path.abspath(path))
    record = find_snapshot(catalog, os.fspath(target))[0] or catalog.snapshots.get(os.fspath(target))
    if record.status != "committed":
        raise CatalogError(
            f"snapshot intent {record.intent_id} is {record.status}, not a published snapshot; nothing was pushed"
        )
    live = [record.out_path] + [
        loc.path for loc in catalog.snapshots.locations(str(record.id)) if loc.removed_at is None
    ]
    found = next((p for p in live if os.path.isdir(p)), None)
    if found is None:
        raise VerifyError(
            f"snapshot {record.id} has no directory on this machine ({record.out_path} is gone), so "
            f"nothing was pushed; {restore_advice(catalog, record)}, then push it"
        )
    return record, Path(found)


def _verified(record: SnapshotRecord, path: Path) -> VerifyReport:
    """The verify report of ``path``, which must hold ``record``'s snapshot intact; VerifyError otherwise."""
    report = verify_snapshot(path, published=True)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise VerifyError(
            f"snapshot {record.id} at {path} failed verification: {report.problems[0]}{more}; nothing "
            "was pushed: restore it (or re-materialise it elsewhere) and push again"
        )
    if report.manifest is None or report.manifest.manifest_hash != record.manifest_hash:
        raise VerifyError(
            f"{path} holds a manifest other than the catalog's for snapshot {record.id}; nothing was pushed"
        )
    return report

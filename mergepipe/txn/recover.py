"""Bring disk and catalog back into agreement after a crash (idempotent): a dead intent is committed when
its output verifies as its snapshot, else aborted; staging directories are removed only when provably
MergePipe's (``publish.remove_staging``), anything else is reported."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.analysis.experts import checkpoint_files, describe_checkpoint
from mergepipe.analysis.provenance import OutputRow, file_outputs, output_rows
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import FileRecord, LocationRecord, SnapshotRecord
from mergepipe.errors import MergePipeError, PlanError, StalePlanError
from mergepipe.spec.canonical import canonical_json
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.txn.publish import DirLock, parse_staging_name, remove_staging, remove_tree, unmark_published
from mergepipe.txn.verify import file_stamps, verify_snapshot


@dataclass
class RecoverReport:
    """What ``recover`` did: snapshot ids committed, intent ids aborted, staging directories removed, intent
    ids left alone (``busy``: a live owner), problems (one line each)."""

    committed: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.committed or self.aborted or self.removed)

    def summary(self) -> str:
        """``committed 1, aborted 0, removed 2 staging directories``, and how many are busy."""
        dirs = "directory" if len(self.removed) == 1 else "directories"
        busy = f", {len(self.busy)} in progress elsewhere" if self.busy else ""
        done = f"committed {len(self.committed)}, aborted {len(self.aborted)}, removed {len(self.removed)}"
        return f"{done} staging {dirs}{busy}"


def recover(catalog: Catalog, also_scan: Sequence[Path] = ()) -> RecoverReport:
    """Commit published-but-uncommitted snapshots, abort dead intents, remove orphan staging directories
    (beside every output the catalog records, and in ``also_scan``: where a publish killed before recording
    its intent left one)."""
    report = RecoverReport()
    records: list[SnapshotRecord | LocationRecord] = [*catalog.snapshots.pending()]
    for record in records + catalog.snapshots.location_intents("pending"):
        _finish(catalog, record, report)
    _remove_orphans(catalog, report, also_scan)
    return report


def _finish(catalog: Catalog, record: SnapshotRecord | LocationRecord, report: RecoverReport) -> None:
    """Commit a dead intent whose output verifies as its snapshot, else abort it; its staging directory goes."""
    location = isinstance(record, LocationRecord)
    out = Path(record.path) if isinstance(record, LocationRecord) else Path(record.out_path)
    staging = Path(record.staging_path)
    if catalog.snapshots.owner_alive(record.intent_id):  # a live merge, perhaps on another machine
        report.busy.append(record.intent_id)
        return
    with _locked((staging, out), record.intent_id, report) as held:
        if not held:
            return
        if isinstance(record, LocationRecord):
            done = out.is_dir() and _commit_location(catalog, record, out, report)
        else:
            done = out.is_dir() and _commit_intent(catalog, record, out, report)
        _remove(staging, record.intent_id, out, report)
        if not done:
            (catalog.snapshots.abort_location if location else catalog.snapshots.abort)(record.intent_id)
            report.aborted.append(record.intent_id)


def _remove(path: Path, intent_id: str, out: Path, report: RecoverReport) -> None:
    existed = os.path.lexists(path)
    problem = remove_staging(path, intent_id, out)
    if problem is not None:
        report.problems.append(problem)
    elif existed:
        report.removed.append(path)


def _lock_if_present(path: Path) -> tuple[bool, DirLock | None]:
    """(present, lock): present but lock ``None`` means a live owner holds it."""
    if not path.is_dir() or path.is_symlink():
        return False, None
    try:
        return True, DirLock.try_acquire(path)
    except FileNotFoundError:  # removed meanwhile
        return False, None


@contextmanager
def _locked(paths: Sequence[Path], intent_id: str, report: RecoverReport) -> Iterator[bool]:
    """Hold locks on whichever of ``paths`` exist; yields False (reported busy, nothing held) if a live
    owner holds one."""
    locks: list[DirLock] = []
    try:
        for path in paths:
            present, lock = _lock_if_present(path)
            if present and lock is None:
                report.busy.append(intent_id)
                yield False
                return
            if lock is not None:
                locks.append(lock)
        yield True
    finally:
        for lock in locks:
            lock.release()


def _commit_location(catalog: Catalog, location: LocationRecord, out: Path, report: RecoverReport) -> bool:
    """Commit a re-materialisation whose rename happened; False after reporting why not."""
    snapshot = catalog.snapshots.get(location.snapshot_id)
    check = verify_snapshot(out, published=True)
    found = check.manifest
    if (
        check.ok
        and found is not None
        and (found.snapshot_id, found.manifest_hash) == (snapshot.id, snapshot.manifest_hash)
    ):
        catalog.snapshots.commit_location(
            location.intent_id,
            current_files(catalog, snapshot.model_id, out),
            file_stamps(out, (f.name for f in found.files)),
        )
        unmark_published(out)
        report.committed.append(snapshot.id or "")
        return True
    why = check.problems[0] if not check.ok else f"it holds snapshot {found.snapshot_id if found else None}"
    report.problems.append(
        f"{out} exists but is not snapshot {snapshot.id} re-materialised by intent "
        f"{location.intent_id} ({why}); left untouched, intent aborted"
    )
    return False


def current_files(catalog: Catalog, model_id: str, out: Path) -> tuple[FileRecord, ...] | None:
    """The weight files of ``out``, a new location of snapshot model ``model_id``, when it is to become
    the current one (for ``commit_location``): when the model's directory no longer exists, or is
    ``out`` itself (re-made in place: the new files' times are recorded). None otherwise."""
    current = catalog.models.get(model_id).uri
    if os.path.isdir(current) and Path(current) != out:
        return None
    return checkpoint_files(open_checkpoint(out))


def _commit_intent(catalog: Catalog, intent: SnapshotRecord, out: Path, report: RecoverReport) -> bool:
    """Commit ``intent`` if ``out`` is its complete snapshot; False after reporting why not (True also when
    the commit was refused: the problem says what was done)."""
    check = verify_snapshot(out, published=True)
    manifest = check.manifest
    why = None
    if not check.ok:
        why = check.problems[0]
    elif manifest is None or manifest.plan_digest != intent.plan_id:
        why = f"its plan digest {manifest.plan_digest if manifest else None} is not the intent's plan {intent.plan_id}"
    elif manifest.model_id != intent.model_id:
        why = f"its model id {manifest.model_id} is not the intent's {intent.model_id}"
    if why is not None or manifest is None:
        report.problems.append(
            f"{out} exists but is not the snapshot of intent {intent.intent_id} ({why}); left untouched, intent aborted"
        )
        return False
    try:
        content = describe_checkpoint(
            open_checkpoint(out), intent.model_id, "snapshot", catalog.block_bytes, catalog.now()
        )
        catalog.snapshots.commit(
            intent.intent_id,
            manifest.snapshot_id,
            manifest.manifest_hash,
            canonical_json(manifest.to_json()).decode("utf-8"),
            content,
            [(manifest.base.id, "base")] + [(e.id, "expert") for e in manifest.experts],
            _provenance(catalog, intent.plan_id, out),
            file_stamps(out, (f.name for f in manifest.files)),  # just verified: they are what was written
        )
    except StalePlanError as exc:  # an input changed: the lineage would be false, so it is never committed
        remove_tree(out)
        report.removed.append(out)
        catalog.snapshots.abort(intent.intent_id)
        report.aborted.append(intent.intent_id)
        report.problems.append(f"{out}: removed, not committed: {exc}")
        return True
    except MergePipeError as exc:  # e.g. the model id was registered meanwhile: keep it pending, say why
        report.problems.append(f"{out}: verified, but committing intent {intent.intent_id} failed: {exc}")
        return True
    unmark_published(out)
    report.committed.append(manifest.snapshot_id)
    return True


def _provenance(catalog: Catalog, plan_id: str, out: Path) -> list[OutputRow]:
    """The output-block rows the merge would have recorded, from the published files; none for a plan that
    does not parse (they only enable reuse by later merges: a snapshot without them is still valid)."""
    try:
        plan = Plan.from_json(catalog.plans.get(plan_id))
    except PlanError:
        return []
    return output_rows(catalog, plan, file_outputs(catalog, plan, out))


def _remove_orphans(catalog: Catalog, report: RecoverReport, also_scan: Sequence[Path]) -> None:
    locations = catalog.snapshots.location_intents()
    pending = {intent.intent_id for intent in catalog.snapshots.pending()}
    pending |= {location.intent_id for location in locations if location.status == "pending"}
    known = {Path(record.out_path).parent for record in catalog.snapshots.list()}
    known |= {Path(location.path).parent for location in locations}
    parents = sorted(known | {Path(os.path.abspath(p)) for p in also_scan})
    for parent in parents:
        try:
            entries = list(os.scandir(parent))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            parsed = parse_staging_name(entry.name)
            if parsed is None or parsed[1] in pending or not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            present, lock = _lock_if_present(path)
            if not present:
                continue
            if lock is None:
                report.busy.append(parsed[1])
                continue
            try:
                _remove(path, parsed[1], parent / parsed[0], report)
            finally:
                lock.release()

"""Verify a published snapshot: every file's size and hash, the manifest hash and snapshot id, files the
manifest does not list, and the card and config file written again from the manifest; ``file_entries``
(a folder's files as manifest entries) and ``file_stamps`` (what `rm` later proves a file by)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import VerifyError
from mergepipe.manifest.manifest import CARD_FORMAT, as_written, card_format, derived_files, read_text
from mergepipe.manifest.manifest import MANIFEST_FILENAME, FileEntry, Manifest, read_manifest, snapshot_id_for
from mergepipe.storage.checkpoint import DERIVED_FILENAMES
from mergepipe.storage.source import FILE_HASH, file_digest
from mergepipe.storage.writer import open_inside
from mergepipe.txn.publish import MARKER


@dataclass
class VerifyReport:
    """What ``verify_snapshot`` found; ``problems`` and ``notes`` (what could not be checked in full, no
    damage) are one line each. ``checked``: every file checked, in order (those the manifest lists, the
    manifest, then the card and config file, ``derived_checked``)."""

    path: Path
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0  # of the files the manifest lists, those found and checked (hash and size)
    checked: list[str] = field(default_factory=list)
    derived_checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise ``VerifyError`` with the first problem (and how many more) if any."""
        if not self.problems:
            return
        if not os.path.lexists(self.path):  # deleted, or a typo: missing, not damaged
            raise VerifyError(
                f"{self.path} is missing: there is no such directory; give the directory of a "
                "published snapshot (or verify by id with --db)"
            )
        if not (self.path / MANIFEST_FILENAME).exists():  # a plain checkpoint: nothing to be damaged
            raise VerifyError(
                f"{self.path} failed verification: {self.problems[0]} (or its manifest was "
                "deleted); verify checks the directories `mergepipe merge` publishes"
            )
        more = f" (and {len(self.problems) - 1} more problem(s))" if len(self.problems) > 1 else ""
        raise VerifyError(
            f"snapshot {self.path} failed verification: {self.problems[0]}{more}; "
            "the snapshot is damaged — restore it or re-run the merge"
        )


def _files_on_disk(root: Path) -> set[str]:
    """Relative posix names of every non-directory entry under ``root``."""
    names: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            names.add((rel / name).as_posix())
    return names


def verify_snapshot(directory: str | Path, published: bool = False) -> VerifyReport:
    """Check a snapshot directory against its ``manifest.json``; never raises for damage. ``published``: a
    directory MergePipe published, where a listed file that is a symbolic link is damage; elsewhere it is
    read through and noted."""
    root = Path(directory)
    report = VerifyReport(path=root)
    if not root.is_dir():
        report.problems.append(f"{root}: {'not a directory' if os.path.lexists(root) else 'missing'}")
        return report
    try:
        manifest, stored = read_manifest(root)
    except VerifyError as exc:
        report.problems.append(str(exc))
        return report
    report.manifest = manifest
    if stored is None:
        report.problems.append(f"{MANIFEST_FILENAME}: has no manifest_hash")
    elif stored != manifest.manifest_hash:
        report.problems.append(
            f"{MANIFEST_FILENAME}: manifest_hash {stored} does not match its fields ({manifest.manifest_hash}); "
            "it was edited"
        )
    expected_id = snapshot_id_for(manifest.plan_digest, manifest.files)
    if manifest.snapshot_id != expected_id:
        report.problems.append(
            f"{MANIFEST_FILENAME}: snapshot_id {manifest.snapshot_id} does not match its plan digest "
            f"and file hashes ({expected_id})"
        )
    linked = []
    for entry in manifest.files:
        path = root / entry.name
        try:
            fd = open_inside(root, entry.name)
        except OSError as exc:  # a link: damage where MergePipe published, a copy's way elsewhere (the Hub's cache)
            if published or exc.errno == errno.ENOENT or not path.is_file():
                report.problems.append(
                    f"{entry.name}: "
                    + ("missing" if not os.path.lexists(path) else "a symbolic link or not a plain file")
                )
                continue
            fd = os.open(path, os.O_RDONLY)
            linked.append(entry.name)
        report.files_checked += 1
        report.checked.append(entry.name)
        size = os.fstat(fd).st_size
        if size != entry.size:
            os.close(fd)
            report.problems.append(f"{entry.name}: size {size} bytes, manifest says {entry.size}")
            continue
        actual = file_digest(fd, entry.algorithm)
        if actual != entry.digest:
            report.problems.append(f"{entry.name}: {entry.algorithm} {actual} differs from manifest {entry.digest}")
    if linked:
        report.notes.append(
            f"{', '.join(linked)}: read through symbolic links, so they can change without this "
            "folder (a copy such as the Hub's cache keeps files so; a folder MergePipe publishes "
            "holds its own)"
        )
    report.checked.append(MANIFEST_FILENAME)
    report.problems += [f"{extra}: not listed in the manifest" for extra in foreign_files(root, manifest)]
    _check_derived(root, manifest, report)
    return report


def foreign_files(root: Path, manifest: Manifest | None) -> list[str]:
    """The files under ``root`` that are not ``manifest``'s snapshot's (all but a staging marker without one)."""
    ours = {MARKER}
    if manifest is not None:
        ours |= {f.name for f in manifest.files} | {MANIFEST_FILENAME, *DERIVED_FILENAMES}
    return sorted(_files_on_disk(root) - ours)


def _check_derived(root: Path, manifest: Manifest, report: VerifyReport) -> None:
    """The card and config file, written again from the manifest and compared; those an earlier MergePipe
    wrote (another ``card_format``) only for naming the snapshot, with a note saying so."""
    current = card_format(manifest) == CARD_FORMAT
    listed = {f.name for f in manifest.files}
    checked = []
    for name, text in derived_files(manifest).items():
        path = root / name
        if name in listed or not path.is_file():
            continue
        report.derived_checked.append(name)
        report.checked.append(name)
        if as_written(manifest, read_text(path), text):
            checked.append(name)
        elif current:
            report.problems.append(f"{name}: differs from the one the manifest describes; it was edited")
        else:
            report.problems.append(
                f"{name}: does not name snapshot {manifest.snapshot_id}; it was edited or belongs to another snapshot"
            )
    if checked and not current:
        report.notes.append(
            f"{' and '.join(checked)}: written by an earlier MergePipe (card format "
            f"{card_format(manifest)}, this one writes {CARD_FORMAT}), so checked only for naming "
            "the snapshot"
        )


def verify_or_raise(directory: str | Path, published: bool = False) -> VerifyReport:
    """``verify_snapshot``'s report if clean, else ``VerifyError`` (first problem)."""
    report = verify_snapshot(directory, published)
    report.raise_for_problems()
    return report


def file_entries(
    directory: str | Path, known: Mapping[str, str] | None = None, algorithm: str = FILE_HASH
) -> tuple[FileEntry, ...]:
    """Every file under ``directory`` but the manifest, card, config file and staging marker, hashed (``known``:
    name -> digest computed as the file was written, not read again), as manifest entries."""
    root = Path(directory)
    known = known or {}
    entries = []
    for name in sorted(_files_on_disk(root) - {MANIFEST_FILENAME, MARKER, *DERIVED_FILENAMES}):
        path = root / name
        digest = known[name] if name in known else file_digest(path, algorithm)
        entries.append(FileEntry(name=name, digest=digest, size=path.stat().st_size, algorithm=algorithm))
    return tuple(entries)


def stamp(found: os.stat_result) -> tuple[int, ...]:
    """What tells the file MergePipe published from another at its path: inode, mtime, ctime (ns) and size."""
    return (found.st_ino, found.st_mtime_ns, found.st_ctime_ns, found.st_size)


def file_stamps(directory: Path, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """``stamp`` of each of the files ``names`` of a snapshot just published (``SnapshotStore.stamps``)."""
    return {name: stamp(os.lstat(directory / name)) for name in names}

"""Open a registered model's checkpoint, after checking it is still what was registered.

The catalog remembers each weight file's size, mtime and header hash at
registration. Before anything reads a model (analysis, a merge), its files
are checked against that record: a missing file or a changed size or mtime
is a ``ModelChangedError`` naming the file, and so is a header that no
longer matches the layout fingerprint. (Block hashes catch a change that
keeps size and mtime.) A merge also checks its base's side files, which it
copies, against their recorded sha256 (names added or removed included).

A remote model (``s3://``, ``http(s)://``) is checked the same way from the
server's metadata, without reading data: its ETag where one was recorded
(an object replaced with other bytes gets another one, even at the same
size), else size and Last-Modified. One listing (S3) or one HEAD per file
(HTTP); block hashes catch what metadata misses, as for local files. A Hub
model is recorded at a commit, whose files cannot change: its check is that
they are still there at their sizes (from the local Hugging Face cache when
it holds them, else one listing of the commit).

In a catalog several machines share (PostgreSQL), a local model whose
directory is missing altogether was most likely registered on another
machine from a path this one does not see: that is said as such.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from mergepipe.analysis.describe import checkpoint_files, layout_fingerprint, side_changes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import FileRecord
from mergepipe.errors import ModelChangedError
from mergepipe.storage.checkpoint import Checkpoint, open_checkpoint, side_files
from mergepipe.storage.location import RemotePath, location
from mergepipe.storage.remote import RemoteClient, RemoteStat


def check_unchanged(catalog: Catalog, model_id: str, client: RemoteClient | None = None) -> None:
    """ModelChangedError if a weight file of ``model_id`` is gone or its size
    or mtime (a remote file's ETag) moved since registration."""
    record = catalog.models.get(model_id)
    root = location(record.uri)
    files = catalog.models.files(model_id)
    if isinstance(root, RemotePath):
        _check_remote(catalog, model_id, root, files, client or RemoteClient())
        return
    if catalog.shared and not os.path.isdir(root):
        raise unreachable(catalog, model_id)
    for file in files:
        path = root / file.name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise changed(catalog, model_id, f"{path} is missing") from None
        except OSError as exc:
            raise changed(catalog, model_id, f"{path}: {exc.strerror}") from None
        if st.st_size != file.size or st.st_mtime_ns != file.mtime_ns:
            raise changed(catalog, model_id, f"{path}")


def _check_remote(catalog: Catalog, model_id: str, root: RemotePath, files: Sequence[FileRecord],
                  client: RemoteClient) -> None:
    if root.scheme == "s3":  # one listing gives every file's metadata
        listed = client.list_dir(root, ())
        stats: dict[str, RemoteStat | None] = {f.name: listed.get(f.name) for f in files}
    else:
        stats = {p.name: s for p, s in client.stat_many(root / f.name for f in files).items()}
    for file in files:
        stat = stats[file.name]
        if stat is None:
            raise changed(catalog, model_id, f"{root / file.name} is missing")
        if not remote_matches(file, stat):
            raise changed(catalog, model_id, f"{root / file.name}: its ETag, size or Last-Modified differ")


def remote_matches(file: FileRecord, stat: RemoteStat) -> bool:
    """Whether a remote file is still the registered one: same size, and the same ETag where both have
    one, else the same Last-Modified."""
    if stat.size != file.size:
        return False
    if file.etag is not None and stat.etag is not None:
        return stat.etag == file.etag
    return stat.mtime_ns == file.mtime_ns


def open_registered(catalog: Catalog, model_id: str, sides: bool = False) -> Checkpoint:
    """The model's checkpoint, opened and checked against its registration; with ``sides`` (a merge's base)
    the sha256 of its side files too, where they were recorded (read whole: they are small).

    A remote one is checked from what opening it fetched (its files' metadata and headers), so the check
    costs no request of its own (but for the side files)."""
    record = catalog.models.get(model_id)
    root = location(record.uri)
    if isinstance(root, RemotePath):
        checkpoint = open_checkpoint(root)
        opened = {f.name: f for f in checkpoint_files(checkpoint)}
        for file in catalog.models.files(model_id):
            now = opened.get(file.name)
            if now is None:
                raise changed(catalog, model_id, f"{root / file.name} is missing")
            if not remote_matches(file, RemoteStat(now.size, now.etag, now.mtime_ns)):
                raise changed(catalog, model_id, f"{root / file.name}: its ETag, size or Last-Modified differ")
    else:
        check_unchanged(catalog, model_id)
        checkpoint = open_checkpoint(record.uri)
    if layout_fingerprint(checkpoint_files(checkpoint)) != record.fingerprint:
        raise changed(catalog, model_id, f"headers in {record.uri}")
    recorded = record.side_digests
    if sides and recorded is not None and (found := {n: h for n, (_, h) in side_files(checkpoint).items()}) != recorded:
        raise changed(catalog, model_id, f"in {record.uri}: {side_changes(recorded, found)}", "side files")
    return checkpoint


def unreachable(catalog: Catalog, model_id: str) -> ModelChangedError:
    """The error for a model of a shared catalog whose directory this machine does not have: registered on
    another machine, from a path that is not on a filesystem both see."""
    record = catalog.models.get(model_id)
    shown = record.label if len(catalog.models.versions(record.name)) > 1 else model_id
    return ModelChangedError(
        f"model '{shown}' is registered at {record.uri} in shared catalog {catalog.path}, and this machine "
        f"({socket.gethostname()}) has no such directory: a catalog several machines share needs each model under "
        "the same path on all of them (a shared filesystem) or in an object store (s3://, https://)"
    )


def changed(catalog: Catalog, model_id: str, what: str, files: str = "file") -> ModelChangedError:
    """The error for a model whose ``files`` are no longer those registered, with what can be done about it;
    the model named as that exact version (``e1@1``) once its name has several."""
    record = catalog.models.get(model_id)
    shown = record.label if len(catalog.models.versions(record.name)) > 1 else model_id
    return ModelChangedError(
        f"model '{shown}' changed on disk since registration ({files} {what}); {what_now(catalog, model_id)}"
    )


def what_now(catalog: Catalog, model_id: str) -> str:
    """What a user can do about a registered model whose files changed, true for this model: ``--force``
    replaces only the latest version of an id, and never one that a snapshot or a delta was made from
    (lineage must stay true); then the files it was registered with are what its plans and snapshots need,
    and the new ones can be registered as the next version (unless they are already)."""
    record = catalog.models.get(model_id)
    db = catalog.path
    if record.kind == "snapshot":
        return (f"'{record.label}' is a snapshot MergePipe published: put its files back (`mergepipe verify --db "
                f"{db} {record.label}` lists what differs), or re-materialise it into another directory by "
                "executing its plan again (`mergepipe snapshots` shows the plan)")
    latest = catalog.models.latest(record.name)
    users = catalog.models.children(model_id) + catalog.models.deltas_of(model_id)
    if latest is not None and latest.id == record.id and not users:
        return ("re-register it with `mergepipe register --force`, or register the new files as its next "
                "version with --new-version")
    newer = next((v for v in catalog.models.versions(record.name)
                  if v.version > record.version and v.uri == record.uri), None)
    if newer is not None:
        new_files = (f"the new files are registered already, as {newer.label} (from the same directory): "
                     f"merge with {newer.label} instead")
    else:
        version = 1 + (latest.version if latest is not None else record.version)
        new_files = (f"register the new files as {record.name}@{version} (`mergepipe register --db {db} --model-id "
                     f"{record.name} --uri {record.uri} --new-version`) and merge with that")
    labels = [found.label if (found := catalog.models.find(user)) is not None else user for user in users]
    why = (f"{record.label} is an input of {', '.join(labels)}" if users else
           f"{record.label} is not the latest version of '{record.name}'")
    return (f"{why}, so it cannot be replaced: put back the files it was registered with (with their modification "
            f"times, as `cp -p` restores them: sizes and times are what is checked), or {new_files}")

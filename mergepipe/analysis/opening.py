"""Open a registered model's checkpoint, after checking it is still what was registered.

The catalog remembers each weight file's size, mtime and header hash at
registration. Before anything reads a model (analysis, a merge), its files
are checked against that record: a missing file or a changed size or mtime
is a ``ModelChangedError`` naming the file, and so is a header that no
longer matches the layout fingerprint. (Block hashes catch a change that
keeps size and mtime.)

A remote model (``s3://``, ``http(s)://``) is checked the same way from the
server's metadata, without reading data: its ETag where one was recorded
(an object replaced with other bytes gets another one, even at the same
size), else size and Last-Modified. One listing (S3) or one HEAD per file
(HTTP); block hashes catch what metadata misses, as for local files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mergepipe.analysis.describe import checkpoint_files, layout_fingerprint
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import FileRecord
from mergepipe.errors import ModelChangedError
from mergepipe.storage.checkpoint import Checkpoint, open_checkpoint
from mergepipe.storage.location import RemotePath, location
from mergepipe.storage.remote import RemoteClient, RemoteStat


def check_unchanged(catalog: Catalog, model_id: str, client: RemoteClient | None = None) -> None:
    """ModelChangedError if a weight file of ``model_id`` is gone or its size
    or mtime (a remote file's ETag) moved since registration."""
    record = catalog.models.get(model_id)
    root = location(record.uri)
    files = catalog.models.files(model_id)
    if isinstance(root, RemotePath):
        _check_remote(model_id, root, files, client or RemoteClient())
        return
    for file in files:
        path = root / file.name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise changed(model_id, f"{path} is missing") from None
        except OSError as exc:
            raise changed(model_id, f"{path}: {exc.strerror}") from None
        if st.st_size != file.size or st.st_mtime_ns != file.mtime_ns:
            raise changed(model_id, f"{path}")


def _check_remote(model_id: str, root: RemotePath, files: Sequence[FileRecord], client: RemoteClient) -> None:
    if root.scheme == "s3":  # one listing gives every file's metadata
        listed = client.list_dir(root, ())
        stats: dict[str, RemoteStat | None] = {f.name: listed.get(f.name) for f in files}
    else:
        stats = {p.name: s for p, s in client.stat_many(root / f.name for f in files).items()}
    for file in files:
        stat = stats[file.name]
        if stat is None:
            raise changed(model_id, f"{root / file.name} is missing")
        if not remote_matches(file, stat):
            raise changed(model_id, f"{root / file.name}: its ETag, size or Last-Modified differ")


def remote_matches(file: FileRecord, stat: RemoteStat) -> bool:
    """Whether a remote file is still the registered one: same size, and the same ETag where both have
    one, else the same Last-Modified."""
    if stat.size != file.size:
        return False
    if file.etag is not None and stat.etag is not None:
        return stat.etag == file.etag
    return stat.mtime_ns == file.mtime_ns


def open_registered(catalog: Catalog, model_id: str) -> Checkpoint:
    """The model's checkpoint, opened and checked against its registration.

    A remote one is checked from what opening it fetched (its files' metadata and headers), so the check
    costs no request of its own."""
    record = catalog.models.get(model_id)
    root = location(record.uri)
    if isinstance(root, RemotePath):
        checkpoint = open_checkpoint(root)
        opened = {f.name: f for f in checkpoint_files(checkpoint)}
        for file in catalog.models.files(model_id):
            now = opened.get(file.name)
            if now is None:
                raise changed(model_id, f"{root / file.name} is missing")
            if not remote_matches(file, RemoteStat(now.size, now.etag, now.mtime_ns)):
                raise changed(model_id, f"{root / file.name}: its ETag, size or Last-Modified differ")
    else:
        check_unchanged(catalog, model_id)
        checkpoint = open_checkpoint(record.uri)
    if layout_fingerprint(checkpoint_files(checkpoint)) != record.fingerprint:
        raise changed(model_id, f"headers in {record.uri}")
    return checkpoint


def changed(model_id: str, what: str) -> ModelChangedError:
    return ModelChangedError(
        f"model '{model_id}' changed on disk since registration (file {what}); "
        "re-register it with `mergepipe register --force`"
    )


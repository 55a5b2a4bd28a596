"""Where a checkpoint lives: a local path, or a remote object (``s3://``, ``http(s)://``).

A local directory stays a ``pathlib.Path``: every local code path (positional
reads, ``copy_file_range``, ``os.stat``) keeps working on it unchanged. A
remote location cannot be a ``Path``: ``Path("s3://bucket/key")`` collapses
the ``//`` into ``s3:/bucket/key``, a different string that then looks like a
relative local path. ``RemotePath`` is a small immutable value instead: it
joins with ``/`` and has ``.name`` like a ``Path``, so code that only builds
names (``root / file.name``) works on both, but it has no ``__fspath__``, so
nothing can open, stat or copy it as a local file by accident (``open`` and
``os`` calls raise ``TypeError``); reads go through ``storage/remote.py``.

``location(value)`` turns what a user typed (or a catalog ``uri``) into one of
the two. ``file://`` URIs are local paths. Only the schemes MergePipe reads
and tests are accepted; any other ``scheme://`` is refused by name rather than
mistaken for a relative directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Union
from urllib.parse import unquote, urlsplit

from mergepipe.errors import ConfigError

#: The remote schemes MergePipe reads (through fsspec: s3fs for S3, its HTTP filesystem for the others).
REMOTE_SCHEMES = ("s3", "http", "https")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True, order=True)
class RemotePath:
    """A remote object or prefix, as a normalised URI (``s3://bucket/key``, ``https://host/path``).

    Immutable and hashable; ``/`` appends a segment, ``.name`` is the last one.
    Deliberately not ``os.PathLike`` (see the module docstring).
    """

    uri: str

    def __post_init__(self) -> None:
        match = _SCHEME.match(self.uri)
        if match is None or match.group(1).lower() not in REMOTE_SCHEMES:
            raise ValueError(f"not a remote URI: {self.uri!r}")
        rest = self.uri[match.end():].rstrip("/")
        if not rest or rest.startswith("/"):
            raise ConfigError(f"{self.uri!r} names no bucket or host; give e.g. s3://bucket/path/to/model")
        object.__setattr__(self, "uri", f"{match.group(1).lower()}://{rest}")

    @property
    def scheme(self) -> str:
        """``s3``, ``http`` or ``https``."""
        return self.uri.split("://", 1)[0]

    @property
    def name(self) -> str:
        """The last segment (a file name), like ``Path.name``."""
        return self.uri.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        """The location holding this one (the bucket or host itself has no parent beyond it)."""
        head, _, tail = self.uri.rpartition("/")
        return self if head.endswith(":/") or not tail else RemotePath(head)

    def __truediv__(self, name: str) -> RemotePath:
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"cannot join {name!r} to {self.uri}")
        return RemotePath(f"{self.uri}/{name}")

    def __str__(self) -> str:
        return self.uri


#: What every checkpoint reader accepts.
Location = Union[Path, RemotePath]


def is_remote(value: object) -> bool:
    """Whether ``value`` is a remote location, or a string that names one."""
    if isinstance(value, RemotePath):
        return True
    return isinstance(value, str) and (m := _SCHEME.match(value)) is not None and m.group(1).lower() in REMOTE_SCHEMES


def location(value: str | os.PathLike[str] | RemotePath) -> Location:
    """A ``Path`` or a ``RemotePath`` for ``value`` (a user's argument or a catalog ``uri``).

    ``file:///x`` is the local path ``/x``; ``s3://`` and ``http(s)://`` are remote; another
    ``scheme://`` is a ``ConfigError`` (it would otherwise be read as a relative directory).
    """
    if isinstance(value, (RemotePath, Path)):
        return value
    if not isinstance(value, str):
        return Path(value)
    match = _SCHEME.match(value)
    if match is None:
        return Path(value)
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"{value!r} names another host; a file:// URI must be a path on this machine")
        return Path(unquote(parts.path))
    if scheme in REMOTE_SCHEMES:
        return RemotePath(value)
    raise ConfigError(
        f"unsupported location {value!r}: give a local directory, file://, s3:// or http(s):// "
        "(other object stores: copy the checkpoint to one of these)"
    )

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

Credentials in a URL (``http://alice:PASS@host/m``, ``…?X-Amz-Signature=…``)
never reach ``RemotePath.uri``, the form the catalog stores and messages
print: they are split off into ``RemotePath.credentials``, which requests use
and nothing prints, compares or hashes (``storage/credentials.py``: which
parameters are secret, and how a later read gets them back). An http(s) query
string is the location's as a whole: ``root / name`` puts the name before it,
so a token that grants a directory is sent with every file under it. In an
``s3://`` URI a ``?`` is part of the key, as S3 allows, and credentials are
refused (they come from ``AWS_*`` variables, ``~/.aws`` or fsspec's config).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union
from urllib.parse import unquote, urlsplit

from mergepipe.errors import ConfigError
from mergepipe.storage.credentials import (
    Credentials,
    redact,
    remember,
    remembered,
    split_query,
    split_userinfo,
)

#: The remote schemes MergePipe reads (through fsspec: s3fs for S3, its HTTP filesystem for the others).
REMOTE_SCHEMES = ("s3", "http", "https")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True, order=True)
class RemotePath:
    """A remote object or prefix, as a normalised URI without credentials (``s3://bucket/key``,
    ``https://host/path``, ``https://host/path?public=query``) and the credentials to read it with.

    Immutable and hashable; ``/`` appends a segment, ``.name`` is the last one. ``RemotePath(typed)`` splits
    credentials off a URL as typed; made without any, it gets those this process was given for a location
    above it (``credentials.remembered``). Deliberately not ``os.PathLike`` (see the module docstring).
    """

    uri: str
    credentials: Credentials | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        match = _SCHEME.match(self.uri)
        if match is None or match.group(1).lower() not in REMOTE_SCHEMES:
            raise ValueError(f"not a remote URI: {redact(self.uri)!r}")
        scheme = match.group(1).lower()
        rest = self.uri[match.end():]
        netloc, slash, path = rest.partition("/")
        host, user, password = split_userinfo(netloc)
        if scheme == "s3":
            if user is not None or split_query(path.partition("?")[2])[1]:
                raise ConfigError(f"{redact(self.uri)!r}: an s3:// URI carries no credentials; give them as AWS_* "
                                  "variables, in ~/.aws or in fsspec's config")
            query, given = "", None
        else:
            path, _, query = path.partition("#")[0].partition("?")  # a fragment is never sent
            query, secret = split_query(query)
            given = Credentials(user, password, secret) if user is not None or secret else None
        if not host:
            raise ConfigError(f"{redact(self.uri)!r} names no bucket or host; give e.g. s3://bucket/path/to/model")
        base = f"{scheme}://{host}{slash}{path}".rstrip("/")
        object.__setattr__(self, "uri", base + (f"?{query}" if query else ""))
        if given is not None:
            remember(base, given)
        object.__setattr__(self, "credentials", given or self.credentials or remembered(base))

    @property
    def scheme(self) -> str:
        """``s3``, ``http`` or ``https``."""
        return self.uri.split("://", 1)[0]

    @property
    def base(self) -> str:
        """The URI without its query string (an ``s3://`` URI keeps its ``?``: part of the key)."""
        return self.uri if self.scheme == "s3" else self.uri.partition("?")[0]

    @property
    def query(self) -> str:
        """The public query string (without ``?``), sent with every request under this location."""
        return "" if self.scheme == "s3" else self.uri.partition("?")[2]

    @property
    def name(self) -> str:
        """The last segment (a file name), like ``Path.name``."""
        return self.base.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        """The location holding this one (the bucket or host itself has no parent beyond it)."""
        head, _, tail = self.base.rpartition("/")
        return self if head.endswith(":/") or not tail else self._with_base(head)

    def __truediv__(self, name: str) -> RemotePath:
        if (not name or name.startswith("/") or ".." in name.split("/")
                or (self.scheme != "s3" and ("?" in name or "#" in name))):
            raise ValueError(f"cannot join {name!r} to {self.uri}")
        return self._with_base(f"{self.base}/{name}")

    def _with_base(self, base: str) -> RemotePath:
        return RemotePath(base + (f"?{self.query}" if self.query else ""), self.credentials)

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
            raise ConfigError(f"{redact(value)!r} names another host; a file:// URI must be a path on this machine")
        return Path(unquote(parts.path))
    if scheme in REMOTE_SCHEMES:
        return RemotePath(value)
    raise ConfigError(
        f"unsupported location {redact(value)!r}: give a local directory, file://, s3:// or http(s):// "
        "(other object stores: copy the checkpoint to one of these)"
    )

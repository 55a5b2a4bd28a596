"""Where a catalog is: a SQLite file (a path) or a PostgreSQL database (a ``postgresql://`` URL).

``--db``, ``$MERGEPIPE_DB`` and every ``Catalogish`` argument say one or the
other; ``catalog_location`` tells them apart once, at the boundary. A URL is
kept as a ``ServerURL``, whose text (``str``) never shows a password: it is
what messages, tables and suggested commands print, while the connection
uses the URL as given (a password may also come from ``PGPASSWORD`` or
``~/.pgpass``, as for every libpq client).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from mergepipe.errors import CatalogError, ConfigError
from mergepipe.storage.location import split_url

#: URL schemes of a PostgreSQL catalog (libpq accepts both).
SERVER_SCHEMES = ("postgresql", "postgres")
#: Query keys of a URL that are secrets: left out of what is shown.
_SECRET_KEYS = frozenset({"password", "sslpassword"})


@dataclass(frozen=True)
class ServerURL:
    """A PostgreSQL catalog's URL, refused when malformed (``split_url``; a ``%`` that starts no escape in its
    userinfo, which libpq would quote); ``str()`` is the URL without its password."""

    url: str

    def __post_init__(self) -> None:
        split_url(self.url)
        if re.search(r"%(?![0-9A-Fa-f]{2})", urlsplit(self.url).netloc.rpartition("@")[0]):
            raise ConfigError(f"catalog {self}: the user or password in the URL holds a % that starts no %XX "
                              "escape; write a % there as %25")

    @property
    def secrets(self) -> tuple[str, ...]:
        """The password and the secret query values, as typed: what no message may show (``redact``)."""
        parts = urlsplit(self.url)
        query = (p.partition("=") for p in parts.query.split("&"))
        return (parts.netloc.rpartition("@")[0].partition(":")[2], *(v for k, _, v in query if k in _SECRET_KEYS))

    def __str__(self) -> str:
        parts = urlsplit(self.url)
        netloc = parts.netloc.rpartition("@")
        if netloc[1]:
            user = netloc[0].partition(":")[0]
            shown_netloc = f"{user}@{netloc[2]}"
        else:
            shown_netloc = parts.netloc
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in _SECRET_KEYS])
        return f"postgresql://{shown_netloc}{parts.path}" + (f"?{query}" if query else "")

    @property
    def sqlalchemy_url(self) -> str:
        """The URL as SQLAlchemy takes it (its psycopg 3 driver), password included: for connecting only."""
        return "postgresql+psycopg://" + self.url.split("://", 1)[1]


#: What a catalog location is: a SQLite file or a PostgreSQL database.
Location = Path | ServerURL


def is_server_url(text: str) -> bool:
    """Whether ``text`` names a PostgreSQL catalog rather than a file."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in SERVER_SCHEMES


def catalog_location(value: str | os.PathLike[str] | ServerURL) -> Location:
    """A path or URL as a ``Location``; another URL scheme (``mysql://``, ``sqlite://``) is refused by name
    rather than taken for a file name."""
    if isinstance(value, ServerURL):
        return value
    text = os.fspath(value)
    if is_server_url(text):  # libpq's defaults fill what it leaves out (host: the local socket; database: the user)
        return ServerURL(text)
    scheme, sep, _ = text.partition("://")
    if sep and scheme.isidentifier():
        raise CatalogError(f"--db {scheme}://...: a catalog is a SQLite file path or a postgresql:// URL")
    return Path(text)

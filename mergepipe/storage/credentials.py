"""Credentials a URL carries: used for its requests, never stored or printed.

A user may type ``http://alice:PASS@host/model`` or a signed URL
(``…/model?X-Amz-Signature=…``, ``?sig=…``, ``?token=…``). What such a URL
*names* is ``http://host/model`` (plus any non-secret query parameters): that
is the ``RemotePath.uri`` the catalog stores and every message prints. What it
*carries* (the userinfo, and the query parameters ``is_secret_param`` flags)
becomes a ``Credentials`` value held beside the uri, sent with the requests
only (userinfo as HTTP basic auth, parameters appended to each URL), and kept
out of ``repr``, equality and hashing.

Re-reading. The catalog keeps the uri without credentials, so a model is
re-opened from its uri later. Within the process (one command) that was given
the credentials, they are remembered (``remember``) for the location they came
with and everything under it: a uri read back from the catalog by the same
command gets them again, so ``merge http://alice:PASS@host/e1 …`` registers,
analyses and merges in one go. This process-wide keyring is the one piece of
global state here, on purpose: the alternative is to carry the secret through
catalog records, which is how it would end up stored. A later command that was
not given them reads ``~/.netrc`` (or ``$NETRC``: ``machine HOST login USER
password PASSWORD``, as curl and requests do) and fsspec's HTTP config (e.g.
``FSSPEC_HTTP='{"headers": {"Authorization": "Bearer …"}}'``); when the server
still asks, the error says in one line that MergePipe does not store
credentials and how to give them again (``missing_credentials_hint``).

A signed URL names one object, and its signature expires: a later command
needs a freshly signed URL, given again like the first one. ``redact`` is the
one redaction of every message that may quote a URL or a library's text.
"""

from __future__ import annotations

import netrc
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from mergepipe.errors import ConfigError

#: Query parameters that carry a secret or only make sense with one (case-insensitive): AWS SigV2/SigV4
#: presigned URLs (every ``X-Amz-*``: credential, signature, token, and the date/expiry they sign), GCS
#: signed URLs (``X-Goog-*``), CloudFront (``Policy``, ``Signature``, ``Key-Pair-Id``), Azure SAS
#: (``sig``), and the usual token and key names.
SECRET_PARAMS = frozenset({
    "signature", "sig", "expires", "awsaccesskeyid", "policy", "key-pair-id", "token", "access_token",
    "auth", "authorization", "key", "api_key", "apikey", "api-key", "password", "passwd", "secret", "code",
})
SECRET_PARAM_PREFIXES = ("x-amz-", "x-goog-")
#: A parameter whose name contains one of these is a secret too (``id_token``, ``client_secret`` …).
SECRET_PARAM_PARTS = ("token", "signature", "secret", "password", "credential")

#: How a redacted userinfo or parameter value is shown in messages about the URL as typed.
REDACTED = "***"
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@]*)@")


def is_secret_param(name: str) -> bool:
    """Whether query parameter ``name`` is kept out of stored and printed URIs."""
    name = unquote(name).lower()
    return (name in SECRET_PARAMS or name.startswith(SECRET_PARAM_PREFIXES)
            or any(part in name for part in SECRET_PARAM_PARTS))


@dataclass(frozen=True, repr=False)
class Credentials:
    """What a URL carried for its requests: user and password (basic auth), secret query parameters
    (``name=value`` exactly as typed, appended to every request under the location)."""

    username: str | None = None
    password: str | None = None
    params: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return "Credentials(***)"

    @property
    def basic_auth(self) -> tuple[str, str] | None:
        """``(user, password)`` for HTTP basic auth, or ``None`` without userinfo."""
        return None if self.username is None else (self.username, self.password or "")

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every secret this carries, for ``redact`` (a library's message may quote the URL)."""
        return (self.password or "", *self.params, *(p.partition("=")[2] for p in self.params))


def split_query(query: str) -> tuple[str, tuple[str, ...]]:
    """``(public, secret)``: the query's ``&``-separated parameters as typed, the public ones joined again."""
    pieces = [p for p in query.split("&") if p]
    public = "&".join(p for p in pieces if not is_secret_param(p.partition("=")[0]))
    return public, tuple(p for p in pieces if is_secret_param(p.partition("=")[0]))


def split_userinfo(netloc: str) -> tuple[str, str | None, str | None]:
    """``(host[:port], user, password)``; user and password percent-decoded, ``None`` when absent."""
    userinfo, at, host = netloc.rpartition("@")
    if not at:
        return netloc, None, None
    user, colon, password = userinfo.partition(":")
    return host, unquote(user), unquote(password) if colon else None


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (a URI as typed, or a message quoting one) without userinfo, secret parameter values or any of
    ``secrets`` (as given, percent-decoded or encoded): the one redaction of every message that may quote a URL."""
    variants = {v for s in secrets if s for v in (s, unquote(s), quote(unquote(s), safe=""))}
    for secret in sorted(variants, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)

    def param(match: re.Match[str]) -> str:
        name = match.group(2)
        return f"{match.group(1)}{name}={REDACTED}" if is_secret_param(name) else match.group(0)

    return re.sub(r"([?&])([^=&#\s'\"]+)=([^&#\s'\"]*)", param, text)


# ---------------------------------------------------------------------- the process's keyring

_remembered: dict[str, Credentials] = {}
_lock = threading.Lock()


def remember(location: str, credentials: Credentials) -> None:
    """Lend ``credentials`` to ``location`` (``scheme://host/path``, no query) and everything under it, for
    the rest of this process (see the module docstring)."""
    with _lock:
        _remembered[location.rstrip("/")] = credentials


def remembered(location: str) -> Credentials | None:
    """The credentials this process was given for ``location`` or the nearest location above it."""
    with _lock:
        if not _remembered:
            return None
        key = location.rstrip("/")
        while True:
            found = _remembered.get(key)
            if found is not None:
                return found
            head, sep, _ = key.rpartition("/")
            if not sep or head.endswith(":/"):
                return None
            key = head


def forget_credentials() -> None:
    """Forget every remembered credential (what a new process starts with; for tests)."""
    with _lock:
        _remembered.clear()


# ---------------------------------------------------------------------- given outside the URL


def netrc_credentials(hostname: str, environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The login and password ``$NETRC`` (default ``~/.netrc``) gives for ``hostname`` (no port), if any."""
    env = os.environ if environ is None else environ
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    if not os.path.isfile(path):
        return None
    try:
        entry = netrc.netrc(path).authenticators(hostname)
    except (netrc.NetrcParseError, OSError) as exc:
        raise ConfigError(f"cannot read {path} for the credentials of {hostname}: {exc}; fix or remove it") from None
    if entry is None:
        return None
    login, _, password = entry
    return Credentials(username=login, password=password)


def missing_credentials_hint(uri: str, status: int) -> str:
    """The one line for a server that asks for credentials the command was not given (``uri``: redacted)."""
    parts = urlsplit(uri)
    return (
        f"{uri} needs credentials (HTTP {status}), and MergePipe never stores them (the catalog keeps the URI "
        f"without them): give the URI with them in the command, in place of a model id too ({parts.scheme}://"
        f"USER:PASSWORD@{parts.netloc}/…, or a freshly signed URL), or put them in ~/.netrc (machine "
        f"{parts.hostname} login USER password PASSWORD)"
    )

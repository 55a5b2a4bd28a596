"""Where a checkpoint is: a ``Path`` or a ``RemotePath`` (``s3://``, ``http(s)://``, ``hf://``, a bare Hub id);
credentials a URL carries split off; ``redact``, the one redaction; ``split_url``, the one URL host check.
"""

from __future__ import annotations

import netrc
import os
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union
from urllib.parse import SplitResult, quote, unquote, urlsplit

from mergepipe.errors import ConfigError

#: Query parameters that carry a secret or only make sense with one (case-insensitive): AWS and GCS presigned
#: URLs (every ``X-Amz-*``, ``X-Goog-*``), CloudFront, Azure SAS (``sig``), the usual token and key names.
SECRET_PARAMS = frozenset(
    {
        "signature",
        "sig",
        "expires",
        "awsaccesskeyid",
        "policy",
        "key-pair-id",
        "token",
        "access_token",
        "auth",
        "authorization",
        "key",
        "api_key",
        "apikey",
        "api-key",
        "password",
        "passwd",
        "secret",
        "code",
    }
)
SECRET_PARAM_PREFIXES = ("x-amz-", "x-goog-")
#: A parameter whose name contains one of these is a secret too (``id_token``, ``client_secret`` …).
SECRET_PARAM_PARTS = ("token", "signature", "secret", "password", "credential")

REDACTED = "***"
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@]*)@")


def is_secret_param(name: str) -> bool:
    name = unquote(name).lower()
    return (
        name in SECRET_PARAMS
        or name.startswith(SECRET_PARAM_PREFIXES)
        or any(part in name for part in SECRET_PARAM_PARTS)
    )


@dataclass(frozen=True, repr=False)
class Credentials:
    """What a URL carried for its requests: user and password, secret query parameters (``name=value`` as typed)."""

    username: str | None = None
    password: str | None = None
    params: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return "Credentials(***)"

    @property
    def basic_auth(self) -> tuple[str, str] | None:
        return None if self.username is None else (self.username, self.password or "")

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every secret this carries, for ``redact``."""
        return (self.password or "", *self.params, *(p.partition("=")[2] for p in self.params))


def split_query(query: str) -> tuple[str, tuple[str, ...]]:
    """``(public, secret)``: the query's parameters as typed, the public ones joined again."""
    pieces = [p for p in query.split("&") if p]
    public = "&".join(p for p in pieces if not is_secret_param(p.partition("=")[0]))
    return public, tuple(p for p in pieces if is_secret_param(p.partition("=")[0]))


def split_userinfo(netloc: str) -> tuple[str, str | None, str | None]:
    """``(host[:port], user, password)``, user and password percent-decoded."""
    userinfo, at, host = netloc.rpartition("@")
    if not at:
        return netloc, None, None
    user, colon, password = userinfo.partition(":")
    return host, unquote(user), unquote(password) if colon else None


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without userinfo, secret parameter values or any of ``secrets`` (as given, percent-decoded or
    encoded): the one redaction of every message that may quote a URL."""
    variants = {v for s in secrets if s for v in (s, unquote(s), quote(unquote(s), safe=""))}
    for secret in sorted(variants, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)

    def param(match: re.Match[str]) -> str:
        name = match.group(2)
        return f"{match.group(1)}{name}={REDACTED}" if is_secret_param(name) else match.group(0)

    return re.sub(r"([?&])([^=&#\s'\"]+)=([^&#\s'\"]*)", param, text)


_remembered: dict[str, Credentials] = {}
_lock = threading.Lock()


def remember(location: str, credentials: Credentials) -> None:
    """Lend ``credentials`` to ``location`` (``scheme://host/path``) and everything under it, in this process."""
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
    """Forget every remembered credential (as a new process; for tests)."""
    with _lock:
        _remembered.clear()


def netrc_credentials(hostname: str, environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The login and password ``$NETRC`` (default ``~/.netrc``) gives for ``hostname``, if any."""
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


REMOTE_SCHEMES = ("s3", "http", "https", "hf")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: A Hub repository id's parts (letters, digits, ``-_.``; no ``--`` or ``..``, 96 characters in all: checked apart).
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
#: ``ORG/NAME[@REVISION][/PATH]`` after ``hf://``; the Hub's revisions that hold a ``/`` are taken whole.
_HUB_BODY = re.compile(
    rf"^(?P<repo>{_HUB_PART}/{_HUB_PART})(?:@(?P<rev>refs/(?:pr/[0-9]+|convert/[\w.-]+)|[^/]+))?"
    r"(?:/(?P<path>.*))?$"
)
#: Other kinds of Hub repository, which MergePipe does not read.
_HUB_KINDS = ("datasets", "spaces", "buckets", "kernels")
HUB_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: What no branch or tag name can hold (``git check-ref-format``): control characters, spaces, ``~^:?*[\``,
#: ``..``, ``@{``, an empty part or one starting with ``.``, a ``.lock`` or ``.`` at a part's end.
_NOT_A_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|(^|/)\.|\.lock(/|$)|[./]$|^/|^@$")
_HUB_FIX = (
    "an hf:// URI names a model repository: hf://ORG/NAME, hf://ORG/NAME@REVISION (a branch, tag or "
    "commit), optionally /PATH inside it"
)


@dataclass(frozen=True)
class HubLocation:
    """An ``hf://`` location: ``repo_id``, ``revision`` as written (None: the default branch), ``path`` inside."""

    repo_id: str
    revision: str | None
    path: str

    @property
    def commit(self) -> str | None:
        """The revision when it is a commit (40 hex digits), which nothing can move."""
        return self.revision if self.revision is not None and HUB_COMMIT.match(self.revision) else None

    def with_revision(self, revision: str) -> HubLocation:
        return HubLocation(self.repo_id, revision, self.path)

    @property
    def uri(self) -> str:
        revision = "" if self.revision is None else "@" + _quote_revision(self.revision)
        return f"hf://{self.repo_id}{revision}" + (f"/{self.path}" if self.path else "")

    @property
    def fs_path(self) -> str:
        """The path as ``HfFileSystem`` names it."""
        return self.uri[len("hf://") :]


def hub_location(uri: str) -> HubLocation:
    """``hf://ORG/NAME[@REVISION][/PATH]`` split (a revision with a ``/`` is written ``%2F``, except the Hub's
    ``refs/pr/N`` and ``refs/convert/NAME``); a ``ConfigError`` naming the form for anything else."""
    body = uri[len("hf://") :] if uri[:5].lower() == "hf://" else uri
    if "?" in body or "#" in body or "@" in body.partition("/")[0]:
        raise ConfigError(
            f"{redact(uri)!r}: an hf:// URI carries no token or query; give the token as HF_TOKEN or "
            "with `hf auth login` (formerly `huggingface-cli login`)"
        )
    if body.partition("/")[0] in _HUB_KINDS:
        raise ConfigError(f"{uri!r}: MergePipe reads model repositories only; {_HUB_FIX}")
    match = _HUB_BODY.match(body)
    if match is None or len(match["repo"]) > 96 or "--" in match["repo"] or ".." in match["repo"]:
        raise ConfigError(f"{uri!r} is not a Hub model location; {_HUB_FIX}")
    revision = None if match["rev"] is None else unquote(match["rev"])
    path = (match["path"] or "").strip("/")
    if revision == "" or ".." in path.split("/") or "//" in path:
        raise ConfigError(f"{uri!r} is not a Hub model location; {_HUB_FIX}")
    if revision is not None and _NOT_A_REF.search(revision):
        raise ConfigError(
            f"{uri!r}: revision {revision!r} is not a branch, tag or commit name (git refuses control "
            "characters, spaces, ~^:?*[\\, '..' and '@{'); check the revision"
        )
    return HubLocation(match["repo"], revision, path)


def hub_uri(value: str) -> str | None:
    """``hf://ORG/NAME[@REVISION]`` for mergekit's bare Hub id, else None."""
    if _SCHEME.match(value) or value.startswith(("/", ".", "~")):
        return None
    match = _HUB_BODY.match(value)
    if (
        match is None
        or match["path"] is not None
        or len(match["repo"]) > 96
        or "--" in match["repo"]
        or ".." in match["repo"]
    ):
        return None
    return f"hf://{value}"


def split_url(text: str) -> SplitResult:
    """``urlsplit(text)``; a ``ConfigError`` for brackets, a port or a host that no client can use."""
    secrets = [text.partition("://")[2].partition("/")[0].rpartition("@")[0]]  # the userinfo
    try:
        parts = urlsplit(text)
        parts.port
    except ValueError as exc:
        raise ConfigError(
            f"{redact(text, secrets)!r} is not a valid URL ({redact(str(exc), secrets)}); check the host and port"
        ) from None
    odd = next((c for c in parts.netloc.rpartition("@")[2] if unicodedata.category(c)[0] in "CZ"), None)
    if odd is not None:
        raise ConfigError(
            f"{redact(text, secrets)!r}: its host holds the invisible or control character "
            f"U+{ord(odd):04X}; type the host again"
        )
    return parts


def _quote_revision(revision: str) -> str:
    if re.match(r"^refs/(?:pr/[0-9]+|convert/[\w.-]+)$", revision):
        return revision
    return quote(revision, safe="")


@dataclass(frozen=True, order=True)
class RemotePath:
    """A remote object or prefix as a normalised URI without credentials, and the credentials to read it with."""

    uri: str
    credentials: Credentials | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        match = _SCHEME.match(self.uri)
        if match is None or match.group(1).lower() not in REMOTE_SCHEMES:
            raise ValueError(f"not a remote URI: {redact(self.uri)!r}")
        scheme = match.group(1).lower()
        rest = self.uri[match.end() :]
        if scheme == "hf":  # huggingface_hub finds the token: an hf:// URI carries none
            object.__setattr__(self, "uri", hub_location(self.uri).uri)
            object.__setattr__(self, "credentials", None)
            return
        split_url(self.uri)
        netloc, slash, path = rest.partition("/")
        host, user, password = split_userinfo(netloc)
        if scheme == "s3":
            if user is not None or split_query(path.partition("?")[2])[1]:
                raise ConfigError(
                    f"{redact(self.uri)!r}: an s3:// URI carries no credentials; give them as AWS_* "
                    "variables, in ~/.aws or in fsspec's config"
                )
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
        return self.uri.split("://", 1)[0]

    @property
    def hub(self) -> HubLocation | None:
        return hub_location(self.uri) if self.scheme == "hf" else None

    @property
    def base(self) -> str:
        """The URI without its query string."""
        return self.uri if self.scheme in ("s3", "hf") else self.uri.partition("?")[0]

    @property
    def query(self) -> str:
        """The public query string, sent with every request under this location."""
        return "" if self.scheme in ("s3", "hf") else self.uri.partition("?")[2]

    @property
    def name(self) -> str:
        return self.base.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        """The location holding this one (a bucket, host or repository is its own)."""
        head, _, tail = self.base.rpartition("/")
        hub = self.hub
        if head.endswith(":/") or not tail or (hub is not None and not hub.path):  # a repository has none either
            return self
        return self._with_base(head)

    def __truediv__(self, name: str) -> RemotePath:
        if (
            not name
            or name.startswith("/")
            or ".." in name.split("/")
            or (self.scheme != "s3" and ("?" in name or "#" in name))
        ):
            raise ValueError(f"cannot join {name!r} to {self.uri}")
        return self._with_base(f"{self.base}/{name}")

    def _with_base(self, base: str) -> RemotePath:
        return RemotePath(base + (f"?{self.query}" if self.query else ""), self.credentials)

    def __str__(self) -> str:
        return self.uri


Location = Union[Path, RemotePath]


def is_remote(value: object) -> bool:
    """Whether ``value`` is a remote location, or a string that names one."""
    if isinstance(value, RemotePath):
        return True
    return isinstance(value, str) and (m := _SCHEME.match(value)) is not None and m.group(1).lower() in REMOTE_SCHEMES


def location(value: str | os.PathLike[str] | RemotePath) -> Location:
    """A ``Path`` or a ``RemotePath`` for a user's argument or a catalog ``uri``."""
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
        f"unsupported location {redact(value)!r}: give a local directory, file://, s3://, http(s):// or hf:// "
        "(other object stores: copy the checkpoint to one of these)"
    )


def model_location(value: str) -> Location:
    """Where the model a user typed is."""
    found = location(value)
    if isinstance(found, RemotePath):
        return found
    hub = hub_uri(value)
    found = found.expanduser()
    return RemotePath(hub) if hub is not None and not found.exists() else found

"""Remote objects (S3, HTTP, the Hugging Face Hub) through fsspec: metadata, exact ranged reads, one retry
policy, every request counted.

``RemoteClient`` is the one place MergePipe talks to an object store, an
HTTP server or the Hub, through one fsspec filesystem per scheme (s3fs,
fsspec's HTTP, huggingface_hub's ``HfFileSystem``); endpoint, region and
credentials come from the usual places (``AWS_*``, ``~/.aws``, fsspec
config; ``HF_ENDPOINT``, ``HF_TOKEN`` or the stored login) and are never
stored by MergePipe.

``read_ranges`` fetches exact byte ranges of one object at once: S3 by s3fs's
``cat_ranges``; HTTP by a ranged GET written here (``_http_get_range``),
because fsspec's HTTP ``cat_file``/``cat_ranges`` read the body before the
status: a server that ignores ``Range`` would send a 5 GB shard for a 64 KiB
header probe, on every retry. Here a 200 to a partial range is refused unread,
as one line naming the server, never retried. HTTP metadata is one HEAD
(``_http_head``): fsspec's HTTP ``info`` falls back to a GET of the whole
object and reports every failure as "not found".

One retry policy (``_call``, tenacity; s3fs's and botocore's own retries are
off, so every try is one counted request): a short or long body, a reset, a
timeout, a 5xx or throttling is tried again with exponential backoff, only
the failed ranges re-asked; a 404, a 403 or missing credentials is one line
at once. The callers compare ETags (``analysis/opening.py``) and block hashes.

The Hub (``hf://``, ``storage/hub.py``) is read at a commit (``pin``): one
listing of it (``HfFileSystem.ls``), then ``cat_ranges`` of exact ranges
(unbuffered: ``cache_type="none"``, so each range is one GET of just its
bytes, which the Hub's CDN serves). huggingface_hub retries its own requests
(``http_backoff``: 429, 5xx, timeouts, resets) and cannot be told not to, so
for the Hub that is the one policy and ``_call`` makes a single try. A file
of the commit that the local Hugging Face cache holds is read there, with no
request; with ``HF_HUB_OFFLINE`` set, only there. Files of a commit never
change, so they carry no ETag or Last-Modified: the commit in the URI is
what the catalog checks, and a range that is a whole file is checked
against the commit's hash of it (``hub.check_whole``).

Credentials in a URL go with its requests only (``storage/credentials.py``),
else ``~/.netrc``'s; messages name the URI without them and scrub what a
library quotes. fsspec, s3fs, aiohttp and tenacity are the optional extra
``mergepipe[remote]``, imported only once a remote URI is used;
huggingface_hub is a dependency, imported only once an ``hf://`` location is.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import os
import shutil
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import urlsplit

from mergepipe.errors import CheckpointError, ConfigError, MergePipeError
from mergepipe.storage import hub
from mergepipe.storage.location import (
    Credentials,
    Location,
    RemotePath,
    missing_credentials_hint,
    netrc_credentials,
    redact,
    remembered,
)
from mergepipe.storage.source import Buffer, LocalFileSource, ReadCounter, WorkItem, _target

T = TypeVar("T")

#: What to install for remote URIs (named in the error when it is missing).
INSTALL_HINT = "pip install 'mergepipe[remote]'"
_NEEDS = {
    "s3": ("fsspec", "s3fs", "tenacity"),
    "http": ("fsspec", "aiohttp", "tenacity"),
    "https": ("fsspec", "aiohttp", "tenacity"),
    "hf": ("fsspec", "huggingface_hub"),
}
#: Schemes whose directories can be listed (one request for every file's metadata); an HTTP server cannot be.
LISTABLE_SCHEMES = ("s3", "hf")


@dataclass(frozen=True)
class RemoteOptions:
    """How remote reads are made; ``from_env`` reads the ``MERGEPIPE_REMOTE_*`` overrides."""

    #: Largest single request: adjacent planned blocks are coalesced up to it, and a larger read is split into
    #: requests of this size fetched concurrently: large enough to amortise a request's latency (tens of ms)
    #: at object-store speeds, small enough that what one coalesced request holds in memory stays small.
    max_request_bytes: int = 8 << 20
    #: Requests in flight at once per source (the read-ahead's threads are raised to it for remote inputs).
    concurrency: int = 8
    #: Tries after the first on a transient error (5xx, throttling, reset, short body).
    retries: int = 4
    #: First backoff; doubled on every further try (0.25 s, 0.5 s, 1 s, 2 s).
    backoff_seconds: float = 0.25
    #: The first read of a safetensors file: the 8-byte length and, almost always, the whole header
    #: (a few tens of KB even for large models); a longer header costs exactly one more read.
    header_probe_bytes: int = 64 << 10
    #: A connection not made, or a read that receives nothing, for this long is a transient error (retried).
    read_timeout_seconds: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemoteOptions:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, key, kind in (
            ("concurrency", "MERGEPIPE_REMOTE_CONCURRENCY", int),
            ("max_request_bytes", "MERGEPIPE_REMOTE_REQUEST_BYTES", int),
            ("retries", "MERGEPIPE_REMOTE_RETRIES", int),
            ("backoff_seconds", "MERGEPIPE_REMOTE_BACKOFF_SECONDS", float),
            ("header_probe_bytes", "MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", int),
        ):
            if key in env:
                try:
                    values[name] = kind(env[key])
                except ValueError:
                    raise ConfigError(f"{key}={env[key]!r} is not a number; unset it or give one") from None
                if values[name] < (0 if name in ("retries", "backoff_seconds") else 1):
                    raise ConfigError(f"{key}={env[key]!r} is out of range; unset it or give a positive number")
        return cls(**values)


@dataclass(frozen=True)
class RemoteStat:
    """What the server says about an object: size, ETag (quotes stripped) and Last-Modified in ns (0: none)."""

    size: int
    etag: str | None
    mtime_ns: int


class ShortBodyError(OSError):
    """A ranged read that returned another number of bytes than asked (retried)."""


class HTTPStatusError(OSError):
    """An HTTP answer with an error status, its body unread (``status`` tells ``_call`` what it means)."""

    def __init__(self, status: int, reason: str | None) -> None:
        super().__init__(f"HTTP {status} {reason or ''}".strip())
        self.status = status


class TransferMeter:
    """Remote traffic of one command, shared by its clients: bytes received and requests made, for the
    progress bars (``status``) and the reports. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.bytes_received = 0
        self.requests = 0

    def add(self, nbytes: int, requests: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.requests += requests

    def __reduce__(self) -> tuple[type[TransferMeter], tuple[()]]:
        """A copy sent to another process (a Ray worker) meters that process's traffic, from zero."""
        return (TransferMeter, ())

    def status(self) -> str:
        """``remote 85.3 MB/s · 120 req`` once a request was made, else empty."""
        with self._lock:
            nbytes, requests = self.bytes_received, self.requests
        if not requests:
            return ""
        rate = nbytes / max(time.monotonic() - self._started, 1e-6) / 1e6
        return f"remote {rate:.1f} MB/s · {requests} req"


class RemoteClient:
    """Remote metadata and exact ranged reads under one retry policy (module docstring). Thread-safe.

    ``requests_by_tag`` counts every request (each try), under the tag the read was made for (``None``
    for metadata and untagged reads); ``meter`` is told of every request and every byte received.
    """

    def __init__(self, options: RemoteOptions | None = None, meter: TransferMeter | None = None) -> None:
        self.options = options or RemoteOptions.from_env()
        self.meter = meter
        self._lock = threading.Lock()
        self._filesystems: dict[str, Any] = {}
        self._requests: dict[str | None, int] = {}
        self._netrc: dict[str, Credentials | None] = {}
        self._hub_lock = threading.Lock()
        self._listed: set[str] = set()  # Hub folders whose listing this client's filesystem holds
        self.retried = 0

    @property
    def requests(self) -> int:
        """Every request made, each try counted."""
        with self._lock:
            return sum(self._requests.values())

    def requests_by_tag(self) -> dict[str, int]:
        """Requests per tag (tagged reads only)."""
        with self._lock:
            return {t: n for t, n in self._requests.items() if t is not None}

    # ------------------------------------------------------------------ metadata

    def pin(self, path: RemotePath, bare: str | None = None) -> RemotePath:
        """``path`` at the commit its revision names now, for the Hub (``hub.pinned``; one request unless it
        names a commit already); any other location as it is. ``bare``: the bare ``ORG/NAME`` a user typed
        for it, which a local folder of that name would have been: a failure says there is none (the id may
        be a mistyped path)."""
        if path.hub is None or path.hub.commit is not None:
            return path
        if not hub.offline():
            self._count(None, 1)
        try:
            return hub.pinned(path)
        except CheckpointError as exc:
            if bare is None:
                raise
            raise CheckpointError(f"{exc} (read as a Hub id: there is no local folder {bare})") from None

    def stat(self, path: RemotePath) -> RemoteStat | None:
        """The object's size, ETag and Last-Modified; ``None`` when it does not exist."""
        if path.scheme == "hf":
            return self._hub_stat(path)
        fs = self._fs(path)

        def head() -> dict[str, Any]:
            self._count(None, 1)
            if path.scheme == "s3":
                return fs.info(_key(path), refresh=True)
            return _on_loop(fs, _http_head, fs, *self._http_request(fs, path))

        info = self._call(path, "metadata", head, missing_ok=True)
        return None if info is None or info.get("type", "file") != "file" else _stat(path, info)

    def stat_many(self, paths: Iterable[RemotePath]) -> dict[RemotePath, RemoteStat | None]:
        """``stat`` of several objects, ``concurrency`` at a time."""
        paths = list(paths)
        with ThreadPoolExecutor(max_workers=max(1, min(self.options.concurrency, len(paths) or 1))) as pool:
            return dict(zip(paths, pool.map(self.stat, paths)))

    def list_dir(self, root: RemotePath, candidates: Iterable[str]) -> dict[str, RemoteStat]:
        """The objects directly under ``root`` by name. S3 lists them (one request); HTTP cannot list a
        directory, so each of ``candidates`` is asked for instead. Empty when there is nothing."""
        if root.scheme not in LISTABLE_SCHEMES:
            found = self.stat_many(root / name for name in candidates)
            return {p.name: s for p, s in found.items() if s is not None}
        if root.scheme == "hf":
            return self._hub_list(root)
        fs = self._fs(root)

        def listing() -> list[dict[str, Any]]:
            self._count(None, 1)
            return fs.ls(_key(root), detail=True, refresh=True)

        entries = self._call(root, "listing", listing, missing_ok=True)
        return {e["name"].rsplit("/", 1)[-1]: _stat(root, e) for e in entries or () if e.get("type") == "file"}

    # ------------------------------------------------------------------ data

    def read(self, path: RemotePath, begin: int, end: int, tag: str | None = None) -> bytes:
        """Exactly bytes ``[begin, end)`` of ``path`` (one request, retried when transient)."""
        return self.read_ranges(path, [(begin, end)], tag)[0]

    def read_ranges(self, path: RemotePath, ranges: Sequence[tuple[int, int]], tag: str | None = None) -> list[bytes]:
        """Exactly the bytes of each ``(begin, end)`` of ``path``: one request per range, all at once (callers
        pass at most ``concurrency``); a try re-asks only the ranges that failed."""
        if path.scheme == "hf" and (local := self._hub_local(path)) is not None:
            return _local_ranges(local, ranges)
        fs = self._fs(path)
        got = {i: b"" for i, (begin, end) in enumerate(ranges) if end <= begin}

        def attempt() -> None:
            todo = [i for i in range(len(ranges)) if i not in got]
            self._count(tag, len(todo))
            errors: list[BaseException] = []
            for i, answer in zip(todo, self._get(fs, path, [ranges[i] for i in todo])):
                size = ranges[i][1] - ranges[i][0]
                if isinstance(answer, bytes) and len(answer) == size:
                    got[i] = answer
                    if self.meter is not None:
                        self.meter.add(size, 0)
                else:
                    errors.append(
                        answer
                        if isinstance(answer, BaseException)
                        else ShortBodyError(f"asked for {size} bytes, got {len(answer)}")
                    )
            if errors:
                raise min(errors, key=_transient)  # a permanent error first: it ends the tries

        if len(got) < len(ranges):
            self._call(path, f"bytes [{ranges[0][0]}, {ranges[-1][1]})", attempt)
        return [got[i] for i in range(len(ranges))]

    # ------------------------------------------------------------------ internals

    def _get(self, fs: Any, path: RemotePath, ranges: list[tuple[int, int]]) -> list[bytes | BaseException]:
        """One try of each range: the answer's bytes, or the error it met."""
        if path.scheme == "hf":  # unbuffered: each range one GET of exactly its bytes (module docstring)
            entry = self._hub_ls(fs, path.parent).get(path.name)
            starts, ends = [b for b, _ in ranges], [e for _, e in ranges]
            answers: list[bytes | BaseException] = fs.cat_ranges(
                [hub.hub_of(path).fs_path] * len(ranges), starts, ends, on_error="return", cache_type="none"
            )
            for begin, answer in zip(starts, answers):
                if entry is not None and begin == 0 and isinstance(answer, bytes) and len(answer) == entry.size:
                    hub.check_whole(path, entry, answer)  # the whole file: its commit's hash says whether it is
            return answers
        if path.scheme == "s3":
            paths, starts, ends = [_key(path)] * len(ranges), [b for b, _ in ranges], [e for _, e in ranges]
            return fs.cat_ranges(paths, starts, ends, on_error="return")
        url, kwargs = self._http_request(fs, path)
        return _on_loop(fs, _http_get_ranges, fs, url, kwargs, ranges, path)

    def _call(self, path: RemotePath, what: str, fn: Callable[[], T], missing_ok: bool = False) -> T | None:
        """``fn()`` under the one retry policy (module docstring); a permanent error, or the last transient
        one, becomes a one-line ``CheckpointError``."""
        if path.scheme == "hf":
            return self._hub_call(path, what, fn, missing_ok)
        import tenacity

        policy = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.options.retries + 1),
            wait=tenacity.wait_exponential(multiplier=self.options.backoff_seconds),
            retry=tenacity.retry_if_exception(_transient),
            before_sleep=self._note_retry,
            reraise=True,
        )
        try:
            return policy(fn)
        except _transient_errors() as exc:
            status = (
                404 if isinstance(exc, FileNotFoundError) else 403 if isinstance(exc, PermissionError) else _status(exc)
            )
            if status == 404 and missing_ok:
                return None
            if status == 404:
                raise CheckpointError(f"{path} is not there (404); re-register the model if its files moved") from None
            if status in (401, 403):
                raise self._denied(path, status) from None
            if isinstance(exc, _no_credentials_errors()):
                raise CheckpointError(
                    f"no credentials found for {path}; set the AWS_* variables, ~/.aws or fsspec "
                    "config, then run the command again"
                ) from None
            if not _transient(exc):
                raise CheckpointError(
                    f"cannot read {path} ({what}): the server answered HTTP {status}; check the "
                    "URI and the credentials, then run the command again"
                ) from None
            reason = self._scrub(path, f"{type(exc).__name__}: {exc}".strip().rstrip(":").replace("\n", " "))
            raise CheckpointError(
                f"cannot read {path} ({what}) after {self.options.retries + 1} tries (last: {reason[:200]}); "
                "check the connection or the server, then run the command again"
            ) from None

    # ------------------------------------------------------------------ the Hub (module docstring)

    def _hub_call(self, path: RemotePath, what: str, fn: Callable[[], T], missing_ok: bool) -> T | None:
        """``fn()`` once (huggingface_hub retries its own requests); its failure as one line, a missing file
        as ``None`` where ``missing_ok`` (a missing repository or revision is never that)."""
        try:
            return fn()
        except ShortBodyError:
            raise CheckpointError(
                f"the Hub sent another number of bytes than asked for {path} ({what}); run the command again"
            ) from None
        except hub.errors() as exc:
            if missing_ok and isinstance(exc, FileNotFoundError) and not isinstance(exc.__cause__, hub.errors()):
                return None  # not in the commit's listing (HfFileSystem says so without a cause)
            raise hub.failure(path, exc, what) from None

    def _hub_local(self, path: RemotePath) -> Path | None:
        """The cache's copy of a Hub file (no request); with ``HF_HUB_OFFLINE`` set, an error when there is
        none (one line naming the file)."""
        local = hub.cached_file(path)
        if local is None and hub.offline():
            raise hub.offline_error(path)
        return local

    def _hub_stat(self, path: RemotePath) -> RemoteStat | None:
        """A Hub file's size: from the cache's copy, else the commit's listing (no ETag, no time: module
        docstring); ``None`` when the commit has no such file."""
        local = self._hub_local(path)
        if local is not None:
            return RemoteStat(size=os.stat(local).st_size, etag=None, mtime_ns=0)
        fs = self._fs(path)
        found = self._call(path, "metadata", lambda: self._hub_ls(fs, path.parent).get(path.name), missing_ok=True)
        return None if found is None or found.type != "file" else RemoteStat(found.size, None, 0)

    def _hub_list(self, root: RemotePath) -> dict[str, RemoteStat]:
        """The files directly under ``root`` at its commit, from one listing."""
        if hub.offline():
            raise hub.offline_error(root)
        fs = self._fs(root)
        entries = self._call(root, "listing", lambda: self._hub_ls(fs, root), missing_ok=True)
        return {name: RemoteStat(e.size, None, 0) for name, e in (entries or {}).items() if e.type == "file"}

    def _hub_ls(self, fs: Any, folder: RemotePath) -> dict[str, hub.HubEntry]:
        """``folder``'s listing at its commit (``hub.listing``): one request, the first time; then
        ``HfFileSystem`` keeps it, and opens the files under it from it. Held under a lock while listing, or
        reading threads would all list."""
        with self._hub_lock:
            if folder.uri not in self._listed:
                self._count(None, 1)
            entries = hub.listing(fs, folder)
            self._listed.add(folder.uri)
            return entries

    def _note_retry(self, _state: object) -> None:
        with self._lock:
            self.retried += 1

    def _credentials(self, path: RemotePath) -> Credentials | None:
        """What an http(s) request of ``path`` is sent with: the credentials its URL (or one above it) was
        given in this process, else ``~/.netrc``'s for its host (read once per host)."""
        found = path.credentials or remembered(path.base)
        if found is not None or path.scheme == "s3":
            return found
        host = urlsplit(path.base).hostname or ""  # what ~/.netrc names: the host, without port
        with self._lock:
            if host not in self._netrc:
                self._netrc[host] = netrc_credentials(host)
            return self._netrc[host]

    def _http_request(self, fs: Any, path: RemotePath) -> tuple[Any, dict[str, Any]]:
        """The URL (with the secret query parameters) and the request arguments (fsspec's own, with an
        ``Authorization`` header from the credentials' user and password: aiohttp drops it on a redirect to
        another origin) of an http(s) request of ``path``."""
        credentials = self._credentials(path)
        params = [path.query, *(credentials.params if credentials else ())]
        query = "&".join(p for p in params if p)
        kwargs = dict(fs.kwargs)
        kwargs["headers"] = dict(kwargs.get("headers") or {})
        if credentials is not None and credentials.basic_auth is not None:
            kwargs.pop("auth", None)
            token = base64.b64encode(":".join(credentials.basic_auth).encode()).decode("ascii")
            kwargs["headers"]["Authorization"] = f"Basic {token}"
        return fs.encode_url(path.base + (f"?{query}" if query else "")), kwargs

    def _denied(self, path: RemotePath, status: int) -> CheckpointError:
        """The one line for a 401 or 403: how to give credentials, or which to check."""
        if path.scheme == "s3":
            return CheckpointError(
                f"access to {path} was denied ({status}); check the credentials (AWS_* variables, ~/.aws or fsspec "
                "config) and that they may read it"
            )
        if self._credentials(path) is None:
            return CheckpointError(missing_credentials_hint(str(path), status))
        return CheckpointError(
            f"access to {path} was denied (HTTP {status}) with the credentials given for it; check the user and "
            "password (or sign the URL again: a signature expires) and that they may read it"
        )

    def _scrub(self, path: RemotePath, text: str) -> str:
        """``text`` without the secrets of ``path``'s request (a library's message may quote its URL)."""
        credentials = path.credentials or remembered(path.base)
        return redact(text, credentials.secrets if credentials is not None else ())

    def _count(self, tag: str | None, requests: int) -> None:
        with self._lock:
            self._requests[tag] = self._requests.get(tag, 0) + requests
        if self.meter is not None:
            self.meter.add(0, requests)

    def _fs(self, path: RemotePath) -> Any:
        with self._lock:
            fs = self._filesystems.get(path.scheme)
            if fs is None:
                fs = self._filesystems[path.scheme] = _open_filesystem(path.scheme, self.options)
            return fs


def _open_filesystem(scheme: str, options: RemoteOptions) -> Any:
    """An fsspec filesystem for ``scheme``, with fsspec's own config (``FSSPEC_S3_*`` variables, config
    files) applied and its own retries off (``_call`` is the one policy). fsspec keeps one instance per set
    of arguments: creating an S3 client costs a good part of a second, and every command opens several
    sources. The endpoint in the environment is passed explicitly, so an instance made for another endpoint
    is never reused for this one."""
    if scheme == "hf":
        return hub.filesystem()
    try:
        import fsspec
        from fsspec.config import conf

        for module in _NEEDS[scheme][1:]:
            __import__(module)
    except ImportError as exc:
        raise ConfigError(
            f"reading {scheme}:// URIs needs {' and '.join(_NEEDS[scheme])} (missing: {exc.name}); {INSTALL_HINT}"
        ) from None
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        configured = conf.get("s3", {}).get("config_kwargs", {})
        timeouts = {"connect_timeout": options.read_timeout_seconds, "read_timeout": options.read_timeout_seconds}
        fs = fsspec.filesystem(
            "s3",
            config_kwargs={**timeouts, **configured, "retries": {"total_max_attempts": 1}},
            **({"endpoint_url": endpoint} if endpoint else {}),
        )
        fs.retries = 1  # s3fs's own retry loop: a class attribute, its maintainers' way to set it
        return fs
    import aiohttp

    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=options.read_timeout_seconds, sock_read=options.read_timeout_seconds
    )
    return fsspec.filesystem(scheme, client_kwargs={"timeout": timeout})


def _on_loop(fs: Any, coroutine: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``coroutine(*args)`` run on the filesystem's event loop (fsspec's IO thread), waited for here."""
    from fsspec.asyn import sync_wrapper

    return sync_wrapper(coroutine, obj=fs)(*args)


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Errors a try can end with (``_transient`` tells which are worth another): OS-level ones (resets,
    timeouts, a short body, an HTTP status, s3fs's translation of an S3 error), aiohttp's and botocore's."""
    return (
        OSError,
        TimeoutError,
        asyncio.TimeoutError,  # two classes before Python 3.11
        *hub.installed_classes("aiohttp.ClientError", "botocore.exceptions.BotoCoreError"),
    )


def _no_credentials_errors() -> tuple[type[BaseException], ...]:
    return hub.installed_classes(
        "botocore.exceptions.NoCredentialsError", "botocore.exceptions.PartialCredentialsError"
    )


def _transient(exc: BaseException) -> bool:
    """Whether another try may succeed: a timeout (S3's RequestTimeout is a 400), a 5xx, a 408 or 429, or an
    error with no status (a reset, a short body); not a missing object, a refusal or missing credentials."""
    if isinstance(exc, (FileNotFoundError, PermissionError, *_no_credentials_errors())):
        return False
    status = _status(exc)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or status is None:
        return isinstance(exc, _transient_errors())
    return status >= 500 or status in (408, 429)


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a failed answer: aiohttp's errors and ours carry it; s3fs's translation of an S3
    error keeps botocore's, with the answer, as its cause."""
    status = getattr(exc, "status", None)
    if status is None:
        response = getattr(exc.__cause__, "response", None)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    return status if isinstance(status, int) else None


def _local_ranges(path: Path, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Exact ranges of a local file (a Hub file's copy in the cache)."""
    out = []
    with open(path, "rb") as file:
        for begin, end in ranges:
            file.seek(begin)
            data = file.read(max(0, end - begin))
            if len(data) != max(0, end - begin):
                raise CheckpointError(
                    f"{path} is shorter than expected (the Hugging Face cache's copy is "
                    "truncated); delete it from the cache and run the command again"
                )
            out.append(data)
    return out


def _key(path: RemotePath) -> str:
    """s3fs's name of an object: ``bucket/key``."""
    return path.uri.split("://", 1)[1]


async def _http_head(fs: Any, url: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One HEAD, asked unencoded so its Content-Length is the object's size (module docstring)."""
    session = await fs.set_session()
    headers = {**kwargs["headers"], "Accept-Encoding": "identity"}
    async with session.head(url, **{"allow_redirects": True, **kwargs, "headers": headers}) as response:
        if response.status == 404:
            raise FileNotFoundError(404)
        if response.status >= 400:
            raise HTTPStatusError(response.status, response.reason)
        encoded = response.headers.get("Content-Encoding", "identity") not in ("identity", "")
        return {
            "size": None if encoded else response.content_length,
            "ETag": response.headers.get("ETag"),
            "Last-Modified": response.headers.get("Last-Modified"),
        }


async def _http_get_ranges(
    fs: Any, url: Any, kwargs: dict[str, Any], ranges: list[tuple[int, int]], path: RemotePath
) -> list[bytes | BaseException]:
    return await asyncio.gather(
        *(_http_get_range(fs, url, kwargs, b, e, path) for b, e in ranges), return_exceptions=True
    )


async def _http_get_range(fs: Any, url: Any, kwargs: dict[str, Any], begin: int, end: int, path: RemotePath) -> bytes:
    """Bytes ``[begin, end)`` by one GET whose status and length are checked before its body is read (module
    docstring): a 206 of that range, or a 200 when the range is the whole object. Any other answer closes
    the connection unread: an error status as ``HTTPStatusError`` (``_call`` decides whether to retry), a
    200 to a partial range (a server that ignores ``Range``) as a ``CheckpointError``, never retried."""
    size = end - begin
    headers = {**kwargs["headers"], "Range": f"bytes={begin}-{end - 1}", "Accept-Encoding": "identity"}
    session = await fs.set_session()
    async with session.get(url, **{**kwargs, "headers": headers}) as response:
        status, length = response.status, response.content_length
        if status == 206 and _range_start(response.headers.get("Content-Range")) not in (None, begin):
            response.close()
            raise CheckpointError(
                f"{_server(path)} answered another byte range than the one asked of {path} "
                f"(Content-Range {response.headers['Content-Range']}, asked from {begin}); "
                "serve it from a server with standard Range support"
            )
        if status == 206 or (status == 200 and begin == 0 and length == size):
            if length is not None and length != size:
                response.close()
                raise ShortBodyError(f"asked for {size} bytes, the answer announces {length}")
            try:  # exactly ``size`` bytes: a longer body of unannounced length is cut there, never read whole
                return await response.content.readexactly(size)
            except asyncio.IncompleteReadError as exc:
                raise ShortBodyError(f"asked for {size} bytes, got {len(exc.partial)}") from None
        response.close()
        if status == 404:
            raise FileNotFoundError(str(path))
        if status >= 400:
            raise HTTPStatusError(status, response.reason)
        if status == 200:
            whole_size = f"the whole {length}-byte object" if length is not None else "the whole object"
            raise CheckpointError(
                f"{_server(path)} ignores byte ranges: asked for bytes [{begin}, {end}) of {path}, it answered "
                f"200 with {whole_size}, refused unread; MergePipe reads checkpoints by ranges only: serve them "
                "from a server that supports Range requests, or download the model and register the local copy"
            )
        raise CheckpointError(
            f"{_server(path)} answered HTTP {status} to a byte-range request of {path}; "
            "MergePipe needs 206 Partial Content: check the URI and the server"
        )


def _range_start(content_range: str | None) -> int | None:
    """The first byte of ``Content-Range: bytes a-b/total``; ``None`` when absent or unparsable."""
    if not content_range:
        return None
    unit, _, spec = content_range.strip().partition(" ")
    first = spec.partition("-")[0]
    return int(first) if unit.lower() == "bytes" and first.isdigit() else None


def _server(path: RemotePath) -> str:
    """The server of an http(s) location, as messages name it (``http://host:port``)."""
    parts = urlsplit(path.base)
    return f"{parts.scheme}://{parts.netloc}"


def _stat(path: RemotePath, info: Mapping[str, Any]) -> RemoteStat:
    size = info.get("size")
    if not isinstance(size, int):
        raise CheckpointError(f"{path}: the server gives no size for it; MergePipe needs ranged reads of known sizes")
    etag = info.get("ETag") or info.get("etag")
    return RemoteStat(
        size=size,
        etag=etag.strip('"') if isinstance(etag, str) else None,
        mtime_ns=_mtime_ns(info.get("LastModified") or info.get("Last-Modified")),
    )


def _mtime_ns(value: Any) -> int:
    """Last-Modified as ns since the epoch: a datetime (s3fs) or an HTTP date string; 0 when absent."""
    if isinstance(value, str):
        try:
            value = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 0
    if isinstance(value, datetime):
        return int(value.timestamp()) * 1_000_000_000 + value.microsecond * 1000
    return 0


# ---------------------------------------------------------------------- small whole files, local or remote


def is_file(path: Path | RemotePath, client: RemoteClient | None = None) -> bool:
    """Whether ``path`` is a file: ``Path.is_file`` locally, a HEAD (or listing) remotely."""
    if isinstance(path, Path):
        return path.is_file()
    return (client or RemoteClient()).stat(path) is not None


def read_file(path: Path | RemotePath, client: RemoteClient | None = None) -> bytes:
    """The whole of a small file (a config, a tokenizer): read locally, or with one remote request."""
    if isinstance(path, Path):
        return path.read_bytes()
    client = client or RemoteClient()
    stat = client.stat(path)
    if stat is None:
        raise CheckpointError(f"{path} is not there (404); re-register the model if its files moved")
    return client.read(path, 0, stat.size)


def copy_file(source: Path | RemotePath, target: Path, client: RemoteClient | None = None) -> None:
    """Copy a side file into ``target``: ``shutil.copyfile`` for a local one (as ever), a download for a
    remote one."""
    if isinstance(source, Path):
        shutil.copyfile(source, target)
        return
    target.write_bytes(read_file(source, client))


class _Group:
    """Adjacent planned ranges of one file and tag, fetched as one request by their first reader."""

    def __init__(self, path: RemotePath, begin: int, end: int, tag: str | None) -> None:
        self.path, self.begin, self.end, self.tag = path, begin, end, tag
        self.pending = 0  # planned reads not yet delivered
        self.lock = threading.Lock()
        self.data: bytes | None = None
        self.error: MergePipeError | None = None  # a failed fetch fails its other reads too, without a new request


class RemoteSource:
    """Exact ranged reads of remote objects, coalesced as planned (see the module docstring). Thread-safe."""

    def __init__(self, options: RemoteOptions | None = None, meter: TransferMeter | None = None) -> None:
        self.client = RemoteClient(options, meter)
        self.options = self.client.options
        self._lock = threading.Lock()
        self._planned: dict[tuple[RemotePath, int, int], deque[_Group]] = defaultdict(deque)
        self._counter = ReadCounter()

    def expect(self, reads: Iterable[tuple[RemotePath, int, int, str | None]]) -> None:
        """The planned reads ``(path, begin, end, tag)``, in the order they will be made: runs of adjacent
        ranges of one file and tag become one request of at most ``max_request_bytes``."""
        try:
            from fsspec.utils import merge_offset_ranges
        except ImportError:
            return  # the first read says in one line what to install
        cap = self.options.max_request_bytes
        runs: dict[tuple[RemotePath, str | None], list[list[tuple[int, int]]]] = defaultdict(list)
        for path, begin, end, tag in reads:  # per file and tag, cut where a range starts before the last ends
            if 0 < end - begin <= cap:  # else nothing to read, or split into requests of its own
                file_runs = runs[(path, tag)]
                if file_runs and begin >= file_runs[-1][-1][1]:
                    file_runs[-1].append((begin, end))
                else:
                    file_runs.append([(begin, end)])
        with self._lock:
            for (path, tag), file_runs in runs.items():
                for run in file_runs:  # ascending: merged alike by every fsspec (unsorted input changed over time)
                    _, starts, ends = merge_offset_ranges(
                        [path.uri] * len(run),
                        [b for b, _ in run],
                        [e for _, e in run],
                        max_gap=0,
                        max_block=cap,
                        sort=False,
                    )
                    groups = iter([_Group(path, b, e, tag) for b, e in zip(starts, ends)])
                    group = next(groups)
                    for begin, end in run:
                        if end > group.end:
                            group = next(groups)
                        group.pending += 1
                        self._planned[(path, begin, end)].append(group)

    def size(self, path: RemotePath) -> int:
        stat = self.client.stat(path)
        if stat is None:
            raise FileNotFoundError(str(path))
        return stat.size

    def read(
        self, path: RemotePath, begin: int, end: int, out: Buffer | None = None, tag: str | None = None
    ) -> memoryview:
        """Bytes ``[begin, end)`` of ``path`` into ``out`` (or a new buffer), from a planned group's request,
        else from requests of at most ``max_request_bytes`` (module docstring)."""
        if begin < 0 or end < begin:
            raise ValueError(f"invalid byte range [{begin}, {end}) of {path}")
        view = _target(out, end - begin)
        group = self._take(path, begin, end)
        if group is not None:
            view[:] = self._group_bytes(group, begin, end)
        else:
            self._read_split(path, begin, end, view, tag)
        self._counter.add(end - begin, tag)
        return view

    def _take(self, path: RemotePath, begin: int, end: int) -> _Group | None:
        with self._lock:
            groups = self._planned.get((path, begin, end))
            if not groups:
                return None
            group = groups.popleft()
            if not groups:
                del self._planned[(path, begin, end)]
            return group

    def _group_bytes(self, group: _Group, begin: int, end: int) -> memoryview:
        with group.lock:  # the first reader fetches; the others wait for it, then copy their range
            if group.error is not None:
                raise group.error
            if group.data is None:
                try:
                    group.data = self.client.read(group.path, group.begin, group.end, group.tag)
                except MergePipeError as exc:  # what the client raises once its retries are spent
                    group.error = exc
                    raise
            data = memoryview(group.data)[begin - group.begin : end - group.begin]
            group.pending -= 1
            if group.pending == 0:
                group.data = None  # delivered in full: the slice above keeps what this read needs
            return data

    def _read_split(self, path: RemotePath, begin: int, end: int, view: memoryview, tag: str | None) -> None:
        """``[begin, end)`` in requests of at most ``max_request_bytes``, ``concurrency`` at a time (so at most
        that many requests' bytes are held besides ``view``)."""
        step = self.options.max_request_bytes
        pieces = [(start, min(start + step, end)) for start in range(begin, end, step)]
        for i in range(0, len(pieces), self.options.concurrency):
            window = pieces[i : i + self.options.concurrency]
            for (start, stop), data in zip(window, self.client.read_ranges(path, window, tag)):
                view[start - begin : stop - begin] = data

    def advise_random(self, path: RemotePath) -> None:
        """Nothing to advise: a remote read brings exactly its range."""

    @property
    def bytes_read(self) -> int:
        return self._counter.total

    def bytes_by_tag(self) -> dict[str, int]:
        return self._counter.by_tag()

    def requests_by_tag(self) -> dict[str, int]:
        return self.client.requests_by_tag()

    def close(self) -> None:
        """Drop planned groups; counters stay readable."""
        with self._lock:
            self._planned.clear()


class CheckpointSource:
    """The ``RangeSource`` of analysis and merges: each read goes to a local or a remote source by its path.

    ``meter`` is the command's remote traffic meter; give it when any input is remote, and ``planned``
    then coalesces the planned reads (module docstring). Without one, reads of local files behave exactly
    as ``LocalFileSource``'s.
    """

    def __init__(self, meter: TransferMeter | None = None, options: RemoteOptions | None = None) -> None:
        self.local = LocalFileSource()
        self.meter = meter
        self._options = options
        self._remote: RemoteSource | None = None
        self._lock = threading.Lock()
        self._cached: dict[RemotePath, Path | None] = {}  # Hub files: their copy in the local cache, or None

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def remote(self) -> RemoteSource:
        """The remote source, opened on first use (only then are fsspec and its backends imported)."""
        with self._lock:
            if self._remote is None:
                self._remote = RemoteSource(self._options, self.meter)
            return self._remote

    def size(self, path: Location) -> int:
        where = self._where(path)
        return self.remote.size(where) if isinstance(where, RemotePath) else self.local.size(where)

    def read(
        self, path: Location, begin: int, end: int, out: Buffer | None = None, tag: str | None = None
    ) -> memoryview:
        where = self._where(path)
        if isinstance(where, RemotePath):
            return self.remote.read(where, begin, end, out, tag)
        return self.local.read(where, begin, end, out, tag)

    def advise_random(self, path: Location) -> None:
        where = self._where(path)
        if not isinstance(where, RemotePath):
            self.local.advise_random(where)

    def _where(self, path: Location) -> Location:
        """Where ``path``'s bytes are read: a Hub file's copy in the local cache when there is one (looked up
        once per file), else ``path`` itself."""
        if not isinstance(path, RemotePath) or path.scheme != "hf":
            return path
        with self._lock:
            if path in self._cached:
                return self._cached[path] or path
        local = hub.cached_file(path)
        if local is None and hub.offline():
            raise hub.offline_error(path)
        with self._lock:
            self._cached[path] = local
        return local or path

    def planned(self, items: Iterable[WorkItem]) -> Iterable[WorkItem]:
        """``items`` as they are for local inputs; with a meter (remote inputs), listed once and their remote
        reads told to the remote source (``RemoteSource.expect``) so adjacent ones are coalesced."""
        if self.meter is None:
            return items
        items = list(items)
        self.remote.expect(
            (where, r.begin, r.end, r.tag)
            for item in items
            for r in item.reads
            if isinstance(where := self._where(r.path), RemotePath)
        )
        return items

    def read_threads(self, threads: int) -> int:
        """Read-ahead threads: ``threads`` for local inputs; for remote ones at least the request concurrency,
        since each thread waits on a round trip rather than a disk."""
        if self.meter is None:
            return threads
        return max(threads, (self._options or RemoteOptions.from_env()).concurrency)

    @property
    def bytes_read(self) -> int:
        return self.local.bytes_read + (self._remote.bytes_read if self._remote else 0)

    def bytes_by_tag(self) -> dict[str, int]:
        out = self.local.bytes_by_tag()
        for tag, n in (self._remote.bytes_by_tag() if self._remote else {}).items():
            out[tag] = out.get(tag, 0) + n
        return out

    def requests_by_tag(self) -> dict[str, int]:
        """Remote requests per tag (each try); local reads make none."""
        return self._remote.requests_by_tag() if self._remote else {}

    def close(self) -> None:
        self.local.close()
        if self._remote is not None:
            self._remote.close()

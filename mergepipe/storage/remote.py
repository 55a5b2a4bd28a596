"""Remote objects (S3 and HTTP) through fsspec: metadata, exact ranged reads, retries, every request counted.

``RemoteClient`` is the one place MergePipe talks to an object store or an
HTTP server. It opens one fsspec filesystem per scheme on first use (s3fs for
``s3://``, fsspec's HTTP filesystem for ``http(s)://``); endpoint, region
and credentials come from the usual places (``AWS_*`` environment variables,
``~/.aws``, ``FSSPEC_*`` / fsspec config files) and are never stored by
MergePipe, in the catalog or in a manifest. fsspec's instances are reused
within a process (an S3 client is slow to make), one per endpoint.

Every read asks for an exact byte range and must get exactly those bytes: a
shorter (or longer) body, a dropped connection, a 5xx or a throttling reply
is retried with exponential backoff; a 404 or 403 is permanent and raised at
once as a one-line ``CheckpointError``. Whether the bytes are still the ones
registered is not this module's business: the callers compare ETags
(``analysis/inputs.py``) and block hashes (the engine).

An HTTP read is one GET with a ``Range`` header whose status is checked
before a byte of its body is read (``_http_get_range``): fsspec's
``cat_file`` reads the body first, so a server that ignores ``Range`` and
answers 200 with the whole object would send a 5 GB shard for a 64 KiB header
probe, and again on every retry. Here such an answer is refused at once, the
connection closed unread, as a one-line ``CheckpointError`` naming the server;
it is never retried. A 200 is accepted only when the range asked is the whole
object (from byte 0, and the answer's Content-Length is its end): then the
whole body is exactly what was asked. Bodies are asked unencoded
(``Accept-Encoding: identity``), so lengths are byte counts of the object.

Credentials given in a URL go with its requests only (``storage/credentials.py``):
userinfo as basic auth, secret query parameters appended to each URL;
without them, ``~/.netrc`` is read for the host. Messages name the URI
without them, and what a library's message quotes of the request URL is
scrubbed. A server that asks for credentials this command was not given gets
the one line that says they are not stored and how to give them again.

fsspec, s3fs and aiohttp are an optional extra (``pip install
'mergepipe[remote]'``): nothing imports them until a remote URI is used.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.storage.credentials import (
    Credentials,
    missing_credentials_hint,
    netrc_credentials,
    redact,
    remembered,
)
from mergepipe.storage.location import RemotePath

T = TypeVar("T")

#: What to install for remote URIs (named in the error when it is missing).
INSTALL_HINT = "pip install 'mergepipe[remote]'"
_NEEDS = {"s3": ("fsspec", "s3fs"), "http": ("fsspec", "aiohttp"), "https": ("fsspec", "aiohttp")}


@dataclass(frozen=True)
class RemoteOptions:
    """How remote reads are made; ``from_env`` reads the ``MERGEPIPE_REMOTE_*`` overrides."""

    #: Largest single request: adjacent planned blocks are coalesced up to it, and a larger read is split into
    #: requests of this size fetched concurrently. 8 MiB amortises per-request latency (tens of ms) at
    #: 1 GB/s while keeping what one coalesced request holds in memory small.
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
    #: A read that receives nothing for this long is a transient error (retried).
    read_timeout_seconds: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemoteOptions:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, key, kind in (("concurrency", "MERGEPIPE_REMOTE_CONCURRENCY", int),
                                ("max_request_bytes", "MERGEPIPE_REMOTE_REQUEST_BYTES", int),
                                ("retries", "MERGEPIPE_REMOTE_RETRIES", int),
                                ("backoff_seconds", "MERGEPIPE_REMOTE_BACKOFF_SECONDS", float),
                                ("header_probe_bytes", "MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", int)):
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
    """Remote metadata and exact ranged reads with retries (see the module docstring). Thread-safe.

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

    def stat(self, path: RemotePath) -> RemoteStat | None:
        """The object's size, ETag and Last-Modified; ``None`` when it does not exist."""
        fs = self._fs(path)
        if path.scheme == "s3":
            info = self._call(path, "metadata", lambda: fs.info(_key(path), refresh=True), missing_ok=True)
        else:
            url, kwargs = self._http_request(fs, path)
            info = self._call(path, "metadata", lambda: _http_head(fs, url, kwargs), missing_ok=True)
        return None if info is None else _stat(path, info)

    def stat_many(self, paths: Iterable[RemotePath]) -> dict[RemotePath, RemoteStat | None]:
        """``stat`` of several objects, ``concurrency`` at a time."""
        paths = list(paths)
        with ThreadPoolExecutor(max_workers=max(1, min(self.options.concurrency, len(paths) or 1))) as pool:
            return dict(zip(paths, pool.map(self.stat, paths)))

    def list_dir(self, root: RemotePath, candidates: Iterable[str]) -> dict[str, RemoteStat]:
        """The objects directly under ``root`` by name. S3 lists them (one request); HTTP cannot list a
        directory, so each of ``candidates`` is asked for instead. Empty when there is nothing."""
        if root.scheme != "s3":
            found = self.stat_many(root / name for name in candidates)
            return {p.name: s for p, s in found.items() if s is not None}
        fs = self._fs(root)
        entries = self._call(root, "listing", lambda: fs.ls(_key(root), detail=True, refresh=True), missing_ok=True)
        return {e["name"].rsplit("/", 1)[-1]: _stat(root, e) for e in entries or () if e.get("type") == "file"}

    # ------------------------------------------------------------------ data

    def read(self, path: RemotePath, begin: int, end: int, tag: str | None = None) -> bytes:
        """Exactly bytes ``[begin, end)`` of ``path`` (one request, retried when transient)."""
        if end <= begin:
            return b""
        fs = self._fs(path)
        if path.scheme == "s3":
            key = _key(path)

            def get() -> bytes:
                return fs.cat_file(key, start=begin, end=end)  # type: ignore[no-any-return]
        else:
            url, kwargs = self._http_request(fs, path)

            def get() -> bytes:
                return _http_get_range(fs, url, kwargs, begin, end, path)

        def fetch() -> bytes:
            data = get()
            if len(data) != end - begin:
                raise ShortBodyError(f"asked for {end - begin} bytes, got {len(data)}")
            if self.meter is not None:
                self.meter.add(len(data), 0)
            return data

        return self._call(path, f"bytes [{begin}, {end})", fetch, tag=tag)

    # ------------------------------------------------------------------ internals

    def _call(self, path: RemotePath, what: str, fn: Callable[[], T], missing_ok: bool = False,
              tag: str | None = None) -> T | None:
        """``fn()`` with retries on transient errors; a permanent one is a one-line ``CheckpointError``."""
        transient = _transient_errors()
        last: BaseException | None = None
        for attempt in range(self.options.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(self.options.backoff_seconds * 2 ** (attempt - 1))
            self._count(tag)
            try:
                return fn()
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise CheckpointError(f"{path} is not there (404); re-register the model if its files moved") from None
            except PermissionError:
                raise self._denied(path, 403) from None
            except transient as exc:
                status = _status(exc)
                if status == 404 and missing_ok:
                    return None
                if status in (401, 403):
                    raise self._denied(path, status) from None
                if status is not None and 400 <= status < 500 and status not in (408, 429):
                    raise CheckpointError(
                        f"cannot read {path} ({what}): the server answered HTTP {status}; check the URI and the "
                        "credentials, then run the command again"
                    ) from None
                last = exc
        reason = self._scrub(path, f"{type(last).__name__}: {last}".strip().rstrip(":").replace("\n", " "))
        raise CheckpointError(
            f"cannot read {path} ({what}) after {self.options.retries + 1} tries (last: {reason[:200]}); check the "
            "connection or the server, then run the command again"
        )

    def _credentials(self, path: RemotePath) -> Credentials | None:
        """What an http(s) request of ``path`` is sent with: the credentials its URL (or one above it) was
        given in this process, else ``~/.netrc``'s for its host (read once per host)."""
        found = path.credentials or remembered(path.base)
        if found is not None or path.scheme == "s3":
            return found
        host = _hostname(path)
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
        return redact(credentials.scrub(text) if credentials is not None else text)

    def _count(self, tag: str | None) -> None:
        with self._lock:
            self._requests[tag] = self._requests.get(tag, 0) + 1
        if self.meter is not None:
            self.meter.add(0, 1)

    def _fs(self, path: RemotePath) -> Any:
        with self._lock:
            fs = self._filesystems.get(path.scheme)
            if fs is None:
                fs = self._filesystems[path.scheme] = _open_filesystem(path.scheme, self.options)
            return fs


def _open_filesystem(scheme: str, options: RemoteOptions) -> Any:
    """An fsspec filesystem for ``scheme``, with fsspec's own config (``FSSPEC_S3_*`` variables, config
    files) applied. fsspec keeps one instance per set of arguments: creating an S3 client costs a good part
    of a second, and every command opens several sources. The endpoint in the environment is passed
    explicitly, so an instance made for another endpoint is never reused for this one."""
    try:
        import fsspec

        for module in _NEEDS[scheme][1:]:
            __import__(module)
    except ImportError as exc:
        raise ConfigError(
            f"reading {scheme}:// URIs needs {' and '.join(_NEEDS[scheme])} (missing: {exc.name}); {INSTALL_HINT}"
        ) from None
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return fsspec.filesystem("s3", **({"endpoint_url": endpoint} if endpoint else {}))
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=options.read_timeout_seconds,
                                    sock_read=options.read_timeout_seconds)
    return fsspec.filesystem(scheme, client_kwargs={"timeout": timeout})


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Errors worth another try: OS-level (resets, timeouts, a short body, s3fs's translation of a 5xx),
    aiohttp's client errors (a dropped connection mid-body, an HTTP status, told apart by ``_status``)."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, asyncio.TimeoutError]
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:
        import botocore.exceptions

        errors.append(botocore.exceptions.BotoCoreError)
    except ImportError:
        pass
    return tuple(errors)


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _key(path: RemotePath) -> str:
    """s3fs's name of an object: ``bucket/key``."""
    return path.uri.split("://", 1)[1]


def _hostname(path: RemotePath) -> str:
    """The host of an http(s) location, without port (what ``~/.netrc`` names)."""
    return urlsplit(path.base).hostname or ""


def _http_head(fs: Any, url: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One HEAD request. fsspec's ``info`` falls back to a GET of the whole object and reports every
    failure as "not found", which would read unplanned bytes and make a 503 permanent."""
    from fsspec.asyn import sync
    from fsspec.implementations.http import _file_info

    async def head() -> dict[str, Any]:
        session = await fs.set_session()
        try:
            return await _file_info(url, session=session, size_policy="head", **kwargs)
        except _client_response_error() as exc:
            if exc.status == 404:
                raise FileNotFoundError(url.path) from None
            raise

    return sync(fs.loop, head)


def _http_get_range(fs: Any, url: Any, kwargs: dict[str, Any], begin: int, end: int, path: RemotePath) -> bytes:
    """Bytes ``[begin, end)`` by one GET whose status and length are checked before its body is read (module
    docstring): a 206 of that range, or a 200 when the range is the whole object. Any other answer closes
    the connection unread: an error status as ``HTTPStatusError`` (``_call`` decides whether to retry), a
    200 to a partial range (a server that ignores ``Range``) as a ``CheckpointError``, never retried."""
    from fsspec.asyn import sync

    size = end - begin
    headers = {**kwargs["headers"], "Range": f"bytes={begin}-{end - 1}", "Accept-Encoding": "identity"}

    async def get() -> bytes:
        session = await fs.set_session()
        async with session.get(url, **{**kwargs, "headers": headers}) as response:
            status, length = response.status, response.content_length
            whole = status == 200 and begin == 0 and length == size
            if status == 206 and _range_start(response.headers.get("Content-Range")) not in (None, begin):
                response.close()
                raise CheckpointError(f"{_server(path)} answered another byte range than the one asked of {path} "
                                      f"(Content-Range {response.headers['Content-Range']}, asked from {begin}); "
                                      "serve it from a server with standard Range support")
            if status == 206 or whole:
                if length is not None and length != size:
                    response.close()
                    raise ShortBodyError(f"asked for {size} bytes, the answer announces {length}")
                if length == size:
                    return await response.read()
                data = await _read_at_most(response, size + 1)
                response.close()
                return data
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
            raise CheckpointError(f"{_server(path)} answered HTTP {status} to a byte-range request of {path}; "
                                  "MergePipe needs 206 Partial Content: check the URI and the server")

    return sync(fs.loop, get)


async def _read_at_most(response: Any, limit: int) -> bytes:
    """At most ``limit`` bytes of a body of unannounced length (a longer one is cut there, never read whole)."""
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = await response.content.read(limit - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


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


def _client_response_error() -> type[BaseException]:
    import aiohttp

    return aiohttp.ClientResponseError


def _stat(path: RemotePath, info: Mapping[str, Any]) -> RemoteStat:
    size = info.get("size")
    if not isinstance(size, int):
        raise CheckpointError(f"{path}: the server gives no size for it; MergePipe needs ranged reads of known sizes")
    etag = info.get("ETag") or info.get("etag")
    return RemoteStat(size=size, etag=etag.strip('"') if isinstance(etag, str) else None,
                      mtime_ns=_mtime_ns(info.get("LastModified") or info.get("Last-Modified")))


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

"""Remote objects through fsspec (S3, HTTP, the Hub): ``RemoteClient``, metadata and exact ranged reads under
one retry policy, every request counted; small whole files. The optional extra ``mergepipe[remote]``.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import os
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.storage import hub
from mergepipe.storage.location import (
    Credentials,
    RemotePath,
    missing_credentials_hint,
    netrc_credentials,
    redact,
    remembered,
)

T = TypeVar("T")

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

    #: Largest request: adjacent planned blocks are coalesced up to it, a longer read is split into requests of
    #: it fetched concurrently (amortises a request's latency, bounds what one request holds in memory).
    max_request_bytes: int = 8 << 20
    #: Requests in flight at once per source (the read-ahead's threads are raised to it for remote inputs).
    concurrency: int = 8
    #: Tries after the first on a transient error (5xx, throttling, reset, timeout, short body).
    retries: int = 4
    #: First backoff; doubled on every further try.
    backoff_seconds: float = 0.25
    #: The first read of a safetensors file: its length and, almost always, its whole header.
    header_probe_bytes: int = 64 << 10
    #: A connection not made, or a read that receives nothing, for this long is a transient error.
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
    """What the server says of an object: size, ETag (quotes stripped), Last-Modified in ns (0: none)."""

    size: int
    etag: str | None
    mtime_ns: int


class ShortBodyError(OSError):
    """A ranged read that returned another number of bytes than asked (retried)."""


class ReadCounter:
    """Counts per tag (untagged counts only in the total), safe from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tag: dict[str, int] = defaultdict(int)
        self._total = 0

    def add(self, count: int, tag: str | None) -> None:
        with self._lock:
            self._total += count
            if tag is not None:
                self._by_tag[tag] += count

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def by_tag(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_tag)


class TransferMeter:
    """Remote traffic of one command, shared by its clients: bytes received and requests made. Thread-safe."""

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
        """``remote 85.3 MB/s · 120 req`` once a request was made, else empty (for progress bars)."""
        with self._lock:
            nbytes, requests = self.bytes_received, self.requests
        if not requests:
            return ""
        return f"remote {nbytes / max(time.monotonic() - self._started, 1e-6) / 1e6:.1f} MB/s · {requests} req"


class RemoteClient:
    """Remote metadata and exact ranged reads under one retry policy; thread-safe."""

    def __init__(self, options: RemoteOptions | None = None, meter: TransferMeter | None = None) -> None:
        self.options = options or RemoteOptions.from_env()
        self.meter = meter
        self._lock = threading.Lock()
        self._filesystems: dict[str, Any] = {}
        self._requests = ReadCounter()
        self._netrc: dict[str, Credentials | None] = {}
        self._hub_lock = threading.Lock()
        self._listed: set[str] = set()  # Hub folders whose listing this client's filesystem holds
        self.retried = 0

    @property
    def requests(self) -> int:
        return self._requests.total

    def requests_by_tag(self) -> dict[str, int]:
        return self._requests.by_tag()

    def pin(self, path: RemotePath, bare: str | None = None) -> RemotePath:
        """``path`` at the commit its revision names now, for the Hub (one request unless it names one)."""
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
            local = hub.local_copy(path)
            if local is not None:
                return RemoteStat(size=os.stat(local).st_size, etag=None, mtime_ns=0)
            fs = self._fs(path)
            entry = self._call(path, "metadata", lambda: self._hub_ls(fs, path.parent).get(path.name), True)
            return None if entry is None or entry.type != "file" else RemoteStat(entry.size, None, 0)
        fs = self._fs(path)

        def info() -> dict[str, Any]:
            self._count(None, 1)
            if path.scheme == "s3":
                return fs.info(_key(path), refresh=True)
            url, headers = self._http_request(path)
            try:
                return fs.info(url, headers=headers)
            except FileNotFoundError as exc:  # fsspec's HTTP info asks again by GET when a HEAD fails, and says
                self._count(None, 1)  # "not found" for every failure: the cause (a status, a reset) says which
                raise exc.__cause__ or exc from None

        found = self._call(path, "metadata", info, missing_ok=True)
        return None if found is None or found.get("type", "file") != "file" else _stat(path, found)

    def stat_many(self, paths: Iterable[RemotePath]) -> dict[RemotePath, RemoteStat | None]:
        paths = list(paths)
        with ThreadPoolExecutor(max_workers=max(1, min(self.options.concurrency, len(paths)))) as pool:
            return dict(zip(paths, pool.map(self.stat, paths)))

    def list_dir(self, root: RemotePath, candidates: Iterable[str]) -> dict[str, RemoteStat]:
        """The files directly under ``root`` by name."""
        if root.scheme not in LISTABLE_SCHEMES:
            found = self.stat_many(root / name for name in candidates)
            return {p.name: s for p, s in found.items() if s is not None}
        fs = self._fs(root)
        if root.scheme == "hf":
            if hub.offline():
                raise hub.offline_error(root)
            listed = self._call(root, "listing", lambda: self._hub_ls(fs, root), missing_ok=True)
            return {name: RemoteStat(e.size, None, 0) for name, e in (listed or {}).items() if e.type == "file"}

        def listing() -> list[dict[str, Any]]:
            self._count(None, 1)
            return fs.ls(_key(root), detail=True, refresh=True)

        entries = self._call(root, "listing", listing, missing_ok=True)
        return {e["name"].rsplit("/", 1)[-1]: _stat(root, e) for e in entries or () if e.get("type") == "file"}

    def read(self, path: RemotePath, begin: int, end: int, tag: str | None = None) -> bytes:
        """Exactly bytes ``[begin, end)`` of ``path``."""
        return self.read_ranges(path, [(begin, end)], tag)[0]

    def read_ranges(self, path: RemotePath, ranges: Sequence[tuple[int, int]], tag: str | None = None) -> list[bytes]:
        """Exactly the bytes of each ``(begin, end)`` of ``path``."""
        if path.scheme == "hf" and (local := hub.local_copy(path)) is not None:
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
                elif isinstance(answer, BaseException):
                    errors.append(answer)
                else:
                    errors.append(ShortBodyError(f"asked for {size} bytes, got {len(answer)}"))
            if errors:
                raise min(errors, key=_transient)  # a permanent error first: it ends the tries

        if len(got) < len(ranges):
            self._call(path, f"bytes [{ranges[0][0]}, {ranges[-1][1]})", attempt)
        return [got[i] for i in range(len(ranges))]

    def _get(self, fs: Any, path: RemotePath, ranges: list[tuple[int, int]]) -> list[bytes | BaseException]:
        """One try of each range: its bytes, or the error it met."""
        starts, ends = [b for b, _ in ranges], [e for _, e in ranges]
        if path.scheme == "s3":
            return fs.cat_ranges([_key(path)] * len(ranges), starts, ends, on_error="return")
        if path.scheme == "hf":  # unbuffered: each range one GET of exactly its bytes, which the Hub's CDN serves
            entry = self._hub_ls(fs, path.parent).get(path.name)
            fs_path = hub.hub_of(path).fs_path
            answers = fs.cat_ranges([fs_path] * len(ranges), starts, ends, on_error="return", cache_type="none")
            for begin, answer in zip(starts, answers):
                if entry is not None and begin == 0 and isinstance(answer, bytes) and len(answer) == entry.size:
                    hub.check_whole(path, entry, answer)  # the whole file: its commit's hash says whether it is
            return answers
        url, headers = self._http_request(path)

        def one(begin: int, end: int) -> bytes | BaseException:
            try:
                return _http_range(fs, url, headers, begin, end, path)
            except CheckpointError as exc:
                return exc
            except _transient_errors() as exc:
                return exc

        if len(ranges) == 1:
            return [one(*ranges[0])]
        with ThreadPoolExecutor(max_workers=len(ranges)) as pool:
            return list(pool.map(one, starts, ends))

    def _call(self, path: RemotePath, what: str, fn: Callable[[], T], missing_ok: bool = False) -> T | None:
        """``fn()`` under the one retry policy; a permanent error, or the last transient one, as one line."""
        if path.scheme == "hf":
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
            status = 404 if isinstance(exc, FileNotFoundError) else 403 if isinstance(exc, PermissionError) else None
            status = status or _status(exc)
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

    def _hub_ls(self, fs: Any, folder: RemotePath) -> dict[str, hub.HubEntry]:
        """``folder``'s listing at its commit."""
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
        """What an http(s) request is sent with."""
        found = path.credentials or remembered(path.base)
        if found is not None or path.scheme == "s3":
            return found
        host = urlsplit(path.base).hostname or ""  # what ~/.netrc names: the host, without port
        with self._lock:
            if host not in self._netrc:
                self._netrc[host] = netrc_credentials(host)
            return self._netrc[host]

    def _http_request(self, path: RemotePath) -> tuple[str, dict[str, str]]:
        """The URL (with the secret query parameters) and headers."""
        credentials = self._credentials(path)
        query = "&".join(p for p in (path.query, *(credentials.params if credentials else ())) if p)
        headers = {}
        if credentials is not None and credentials.basic_auth is not None:
            token = base64.b64encode(":".join(credentials.basic_auth).encode()).decode("ascii")
            headers["Authorization"] = f"Basic {token}"
        return path.base + (f"?{query}" if query else ""), headers

    def _denied(self, path: RemotePath, status: int) -> CheckpointError:
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
        """``text`` without the secrets of ``path``'s requests (a library's message may quote its URL)."""
        credentials = path.credentials or remembered(path.base)
        return redact(text, credentials.secrets if credentials is not None else ())

    def _count(self, tag: str | None, requests: int) -> None:
        self._requests.add(requests, tag)
        if self.meter is not None:
            self.meter.add(0, requests)

    def _fs(self, path: RemotePath) -> Any:
        with self._lock:
            if path.scheme not in self._filesystems:
                self._filesystems[path.scheme] = _open_filesystem(path.scheme, self.options)
            return self._filesystems[path.scheme]


def _open_filesystem(scheme: str, options: RemoteOptions) -> Any:
    """An fsspec filesystem for ``scheme`` with fsspec's own config applied."""
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
        fs.retries = 1  # s3fs's own retry loop: no argument sets it; its maintainers point to this attribute
        return fs
    import aiohttp

    seconds = options.read_timeout_seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
    return fsspec.filesystem(scheme, client_kwargs={"timeout": timeout})


def _http_range(fs: Any, url: str, headers: dict[str, str], begin: int, end: int, path: RemotePath) -> bytes:
    """Bytes ``[begin, end)`` by one GET, its status checked before its body is read."""
    size = end - begin
    ranged = {**headers, "Range": f"bytes={begin}-{end - 1}", "Accept-Encoding": "identity"}
    with fs.open(url, "rb", block_size=0, size=size, headers=ranged) as stream:
        answer = stream.r  # the response, its body not read yet
        status, length, served = answer.status, answer.content_length, answer.headers.get("Content-Range")
        server = "{0.scheme}://{0.netloc}".format(urlsplit(path.base))
        first = served.strip().partition(" ")[2].partition("-")[0] if served else ""
        if status == 206 and first.isdigit() and int(first) != begin:
            raise CheckpointError(
                f"{server} answered another byte range than the one asked of {path} (Content-Range {served}, "
                f"asked from {begin}); serve it from a server with standard Range support"
            )
        if status == 200 and not (begin == 0 and length == size):
            whole = f"the whole {length}-byte object" if length is not None else "the whole object"
            raise CheckpointError(
                f"{server} ignores byte ranges: asked for bytes [{begin}, {end}) of {path}, it answered 200 with "
                f"{whole}, refused unread; MergePipe reads checkpoints by ranges only: serve them from a server "
                "that supports Range requests, or download the model and register the local copy"
            )
        if status not in (200, 206):
            raise CheckpointError(
                f"{server} answered HTTP {status} to a byte-range request of {path}; MergePipe needs 206 Partial "
                "Content: check the URI and the server"
            )
        if length is not None and length != size:
            raise ShortBodyError(f"asked for {size} bytes, the answer announces {length}")
        data = bytearray()
        while len(data) < size and (piece := stream.read(size - len(data))):  # never past ``size``
            data += piece
    if len(data) != size:
        raise ShortBodyError(f"asked for {size} bytes, got {len(data)}")
    return bytes(data)


def _transient_errors() -> tuple[type[BaseException], ...]:
    """What a try can end with (``_transient`` tells which are worth another)."""
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
    """Whether another try may succeed."""
    if isinstance(exc, (FileNotFoundError, PermissionError, *_no_credentials_errors())):
        return False
    status = _status(exc)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or status is None:
        return isinstance(exc, _transient_errors())
    return status >= 500 or status in (408, 429)


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a failed answer."""
    status = getattr(exc, "status", None)
    if status is None:
        response = getattr(exc.__cause__, "response", None)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    return status if isinstance(status, int) else None


def _local_ranges(path: Path, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Exact ranges of a Hub file's copy in the cache."""
    out = []
    with open(path, "rb") as file:
        for begin, end in ranges:
            file.seek(begin)
            out.append(file.read(max(0, end - begin)))
            if len(out[-1]) != max(0, end - begin):
                raise CheckpointError(
                    f"{path} is shorter than expected (the Hugging Face cache's copy is truncated); delete it "
                    "from the cache and run the command again"
                )
    return out


def _key(path: RemotePath) -> str:
    """s3fs's name of an object: ``bucket/key``."""
    return path.uri.split("://", 1)[1]


def _stat(path: RemotePath, info: Mapping[str, Any]) -> RemoteStat:
    size = info.get("size")
    if not isinstance(size, int):
        raise CheckpointError(f"{path}: the server gives no size for it; MergePipe needs ranged reads of known sizes")
    etag = info.get("ETag") or info.get("etag")
    modified = info.get("LastModified") or info.get("Last-Modified")  # a datetime (s3fs) or an HTTP date
    if isinstance(modified, str):
        try:
            modified = email.utils.parsedate_to_datetime(modified)
        except (TypeError, ValueError):
            modified = None
    mtime_ns = int(modified.timestamp()) * 10**9 + modified.microsecond * 1000 if isinstance(modified, datetime) else 0
    return RemoteStat(size=size, etag=etag.strip('"') if isinstance(etag, str) else None, mtime_ns=mtime_ns)


def is_file(path: Path | RemotePath, client: RemoteClient | None = None) -> bool:
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
    """Copy a side file into ``target``: ``shutil.copyfile`` for a local one, a download for a remote one."""
    if isinstance(source, Path):
        shutil.copyfile(source, target)
    else:
        target.write_bytes(read_file(source, client))

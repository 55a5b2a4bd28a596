"""The one read pipeline: ``CheckpointSource`` (exact counted range reads, local and remote), ``ReadAhead``
(work items read ahead within a memory window), the block hash, file hashes and ``FileHash``.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterable

import blake3
import numpy as np

from mergepipe.errors import CheckpointError, CorruptCheckpointError, MergePipeError
from mergepipe.storage import hub
from mergepipe.storage.location import Location, RemotePath
from mergepipe.storage.remote import ReadCounter, RemoteClient, RemoteOptions, TransferMeter

#: A writable buffer a read fills (numpy arrays typed apart: numpy declares them buffers for Python >= 3.12 only).
Buffer = bytearray | memoryview | np.ndarray


class _Group:
    """Adjacent planned ranges of one file and tag, fetched as one request by their first reader."""

    def __init__(self, path: RemotePath, begin: int, end: int, tag: str | None) -> None:
        self.path, self.begin, self.end, self.tag = path, begin, end, tag
        self.pending = 0  # planned reads not yet delivered
        self.lock = threading.Lock()
        self.data: bytes | None = None
        self.error: MergePipeError | None = None  # a failed fetch fails its other reads too, without a new request


class CheckpointSource(AbstractContextManager["CheckpointSource"]):
    """Exact ranged reads of local and remote checkpoint files, every byte counted; thread-safe."""

    def __init__(self, meter: TransferMeter | None = None, options: RemoteOptions | None = None) -> None:
        self.meter = meter
        self._options = options
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._closed = False
        self._client: RemoteClient | None = None
        self._cached: dict[RemotePath, Path | None] = {}  # Hub files: their copy in the local cache, or None
        self._planned: dict[tuple[RemotePath, int, int], deque[_Group]] = defaultdict(deque)
        self._counter = ReadCounter()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def client(self) -> RemoteClient:
        """The remote client, made on first use (only then are fsspec and its backends imported)."""
        with self._lock:
            if self._client is None:
                self._client = RemoteClient(self._options, self.meter)
            return self._client

    def read(
        self, path: Location, begin: int, end: int, out: Buffer | None = None, tag: str | None = None
    ) -> memoryview:
        """Bytes ``[begin, end)`` of ``path`` into the prefix of ``out`` (or a new buffer)."""
        if begin < 0 or end < begin:
            raise ValueError(f"invalid byte range [{begin}, {end}) of {path}")
        view = _target(out, end - begin)
        where = self._where(path)
        if end == begin:
            return view
        if isinstance(where, RemotePath):
            self._read_remote(where, begin, end, view, tag)
        else:
            fd, done = self._fd(where), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], begin + done)
                if got == 0:
                    raise CorruptCheckpointError(
                        f"{where} is truncated: it ends at byte {begin + done}, before {end}; re-download or "
                        "re-export it"
                    )
                done += got
        self._counter.add(end - begin, tag)
        return view

    def advise_random(self, path: Location) -> None:
        """No kernel readahead for ``path``: a budgeted merge's sparse reads must not pull unplanned bytes."""
        where = self._where(path)
        if isinstance(where, Path) and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(where), 0, 0, os.POSIX_FADV_RANDOM)

    @property
    def bytes_read(self) -> int:
        return self._counter.total

    def bytes_by_tag(self) -> dict[str, int]:
        return self._counter.by_tag()

    def requests_by_tag(self) -> dict[str, int]:
        """Remote requests per tag (each try); local reads make none."""
        return self._client.requests_by_tag() if self._client is not None else {}

    def close(self) -> None:
        """Close every file and drop planned groups; idempotent, counters stay readable."""
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
            self._planned.clear()
        for fd in fds:
            os.close(fd)

    def _fd(self, path: Path) -> int:
        key = os.fspath(path)
        with self._lock:
            if self._closed:
                raise ValueError("read from a closed CheckpointSource")
            if key not in self._fds:
                try:
                    self._fds[key] = os.open(key, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise CheckpointError(f"{key} disappeared; re-register the model if its files moved") from None
                except OSError as exc:
                    raise CheckpointError(f"cannot open {key}: {exc.strerror}") from None
            return self._fds[key]

    def _where(self, path: Location) -> Location:
        """A Hub file's copy in the local cache when there is one (looked up once per file), else ``path``."""
        if not isinstance(path, RemotePath) or path.scheme != "hf":
            return path
        with self._lock:
            if path in self._cached:
                return self._cached[path] or path
        local = hub.local_copy(path)
        with self._lock:
            self._cached[path] = local
        return local or path

    def _plan(self, items: list[WorkItem]) -> None:
        """Runs of adjacent remote reads of one file and tag, in read order."""
        try:
            from fsspec.utils import merge_offset_ranges
        except ImportError:
            return  # the first read says in one line what to install
        cap = self.client.options.max_request_bytes
        runs: dict[tuple[RemotePath, str | None], list[list[tuple[int, int]]]] = defaultdict(list)
        for r in (r for item in items for r in item.reads):
            where = self._where(r.path)
            if isinstance(where, RemotePath) and 0 < r.end - r.begin <= cap:  # a longer read is split apart
                file_runs = runs[(where, r.tag)]
                if file_runs and r.begin >= file_runs[-1][-1][1]:
                    file_runs[-1].append((r.begin, r.end))
                else:
                    file_runs.append([(r.begin, r.end)])
        with self._lock:
            for (path, tag), file_runs in runs.items():
                for run in file_runs:  # ascending: merged alike by every fsspec (unsorted input changed over time)
                    _, starts, ends = merge_offset_ranges(
                        [path.uri] * len(run), [b for b, _ in run], [e for _, e in run], max_gap=0, max_block=cap
                    )
                    groups = iter([_Group(path, b, e, tag) for b, e in zip(starts, ends)])
                    group = next(groups)
                    for begin, end in run:
                        if end > group.end:
                            group = next(groups)
                        group.pending += 1
                        self._planned[(path, begin, end)].append(group)

    def _read_remote(self, path: RemotePath, begin: int, end: int, view: memoryview, tag: str | None) -> None:
        """From a planned group's request, else in requests of at most ``max_request_bytes``."""
        with self._lock:
            groups = self._planned.get((path, begin, end))
            group = groups.popleft() if groups else None
            if groups is not None and not groups:
                del self._planned[(path, begin, end)]
        if group is not None:
            with group.lock:  # the first reader fetches; the others wait for it, then copy their range
                if group.error is not None:
                    raise group.error
                if group.data is None:
                    try:
                        group.data = self.client.read(group.path, group.begin, group.end, group.tag)
                    except MergePipeError as exc:  # what the client raises once its retries are spent
                        group.error = exc
                        raise
                view[:] = memoryview(group.data)[begin - group.begin : end - group.begin]
                group.pending -= 1
                if group.pending == 0:
                    group.data = None
            return
        options = self.client.options
        step = options.max_request_bytes
        pieces = [(start, min(start + step, end)) for start in range(begin, end, step)]
        for i in range(0, len(pieces), options.concurrency):
            window = pieces[i : i + options.concurrency]
            for (start, stop), data in zip(window, self.client.read_ranges(path, window, tag)):
                view[start - begin : stop - begin] = data


def _target(out: Buffer | None, length: int) -> memoryview:
    """The writable view a read fills: a new buffer, or the prefix of ``out``."""
    if out is None:
        return memoryview(bytearray(length))
    view = (out.data if isinstance(out, np.ndarray) else memoryview(out)).cast("B")
    if view.readonly:
        raise ValueError("out must be a writable buffer")
    if len(view) < length:
        raise ValueError(f"out holds {len(view)} bytes, the range needs {length}")
    return view[:length]


@dataclass(frozen=True)
class BlockCheck:
    """A block inside a read whose bytes must hash to ``digest``: absolute ``[begin, end)``."""

    index: int
    begin: int
    end: int
    digest: str


@dataclass(frozen=True)
class ByteRange:
    """``[begin, end)`` of ``path``, counted under ``tag``; ``checks`` (of a ``kind``) for readers that verify."""

    path: Location
    begin: int
    end: int
    tag: str
    tensor: str = ""
    checks: tuple[BlockCheck, ...] = ()
    kind: str = "block"

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class WorkItem:
    """Something done in order, with the reads it needs (``payload`` is the caller's)."""

    payload: Any
    reads: list[ByteRange] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


class BufferPool:
    """Reusable read buffers, best fit by size (one bisection)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._sizes: list[int] = []  # ``_free``'s sizes, ascending
        self._held = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            k = bisect.bisect_left(self._sizes, nbytes)
            if k < len(self._free):
                self._held -= self._sizes.pop(k)
                return self._free.pop(k)
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            k = bisect.bisect_left(self._sizes, buf.nbytes)
            self._sizes.insert(k, buf.nbytes)
            self._free.insert(k, buf)
            self._held += buf.nbytes
            while self._free and self._held > self.keep_bytes:
                self._held -= self._sizes.pop(0)
                self._free.pop(0)


@dataclass
class Fetched:
    """An item with its bytes (``views[i]`` holds ``item.reads[i]``) and what ``on_read`` returned."""

    item: WorkItem
    views: list[memoryview]
    result: Any = None
    _buffers: list[np.ndarray] | None = None
    _on_release: Callable[[WorkItem, list[np.ndarray]], None] | None = None

    def release(self) -> None:
        buffers, self._buffers = self._buffers, None
        if buffers is not None and self._on_release is not None:
            self._on_release(self.item, buffers)


class ReadAhead:
    """Reads upcoming work items of ``source`` on ``threads`` threads."""

    def __init__(
        self,
        source: CheckpointSource,
        threads: int,
        window_bytes: int,
        on_read: Callable[[WorkItem, list[memoryview]], Any] | None = None,
    ) -> None:
        self.source = source
        remote = source.meter is not None
        self.threads = max(1, threads, source.client.options.concurrency if remote else 1)
        self.window_bytes = max(1, window_bytes)
        self.on_read = on_read
        self.pool = BufferPool(self.window_bytes)
        self._inflight = 0
        self._lock = threading.Lock()
        #: Seconds the reading threads spent reading and running ``on_read``, summed over threads; their bytes.
        self.read_seconds = 0.0
        self.read_bytes = 0

    def run(self, items: Iterable[WorkItem]) -> Generator[Fetched, None, None]:
        """Yield each item, in the order given, once its reads are done."""
        if self.source.meter is not None:  # remote inputs: listed once, adjacent reads planned as one request
            items = list(items)
            self.source._plan(items)
        pending: deque[tuple[WorkItem, Future | None]] = deque()
        upcoming = iter(items)
        item = next(upcoming, None)
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="mergepipe-read") as pool:
            try:
                while True:
                    while item is not None and (not pending or self._fits(item)):
                        pending.append((item, self._submit(pool, item)))
                        item = next(upcoming, None)
                    if not pending:
                        return
                    done, future = pending.popleft()
                    yield future.result() if future is not None else Fetched(done, [])
            finally:
                for _, future in pending:
                    if future is not None:
                        future.cancel()

    def _fits(self, item: WorkItem) -> bool:
        """Whether ``item`` fits in the window beside what is held (a bigger one only when nothing is)."""
        with self._lock:
            return self._inflight == 0 or self._inflight + item.nbytes <= self.window_bytes

    def _submit(self, pool: ThreadPoolExecutor, item: WorkItem) -> Future | None:
        if not item.reads:
            return None
        with self._lock:
            self._inflight += item.nbytes
        return pool.submit(self._fetch, item)

    def _fetch(self, item: WorkItem) -> Fetched:
        started = time.perf_counter()
        buffers = [self.pool.get(r.nbytes) for r in item.reads]
        views = [self.source.read(r.path, r.begin, r.end, out=b, tag=r.tag) for r, b in zip(item.reads, buffers)]
        result = self.on_read(item, views) if self.on_read is not None else None
        with self._lock:
            self.read_seconds += time.perf_counter() - started
            self.read_bytes += item.nbytes
        return Fetched(item, views, result, buffers, self._release)

    def _release(self, item: WorkItem, buffers: list[np.ndarray]) -> None:
        for buf in buffers:
            self.pool.put(buf)
        with self._lock:
            self._inflight -= item.nbytes


#: Out-of-order bytes one file's hash keeps in memory while earlier bytes are still being made (a few blocks of
#: each concurrent unit); beyond it only their places are kept and the bytes read back.
REORDER_BYTES = 64 * 1024 * 1024
#: Bytes per positional read when hashing from a file.
READ_BACK_BYTES = 8 * 1024 * 1024
#: The file hash ``FileHash`` computes and new manifests record (since manifest schema 2); sha256 before it.
FILE_HASH = "blake3"
FILE_HASHES = (FILE_HASH, "sha256")

Bytes = bytes | bytearray | memoryview


def block_digest(data: Bytes) -> str:
    """The block content hash: blake3 hex digest of ``data``."""
    return blake3.blake3(data).hexdigest()


def file_digest(path: str | os.PathLike[str] | int, algorithm: str = FILE_HASH) -> str:
    """Hex digest (one of ``FILE_HASHES``) of the file at ``path`` or open as descriptor ``path`` (closed after)."""
    if algorithm not in FILE_HASHES:
        raise ValueError(f"unknown file hash {algorithm!r}; known: {', '.join(FILE_HASHES)}")
    h = blake3.blake3() if algorithm == FILE_HASH else hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(READ_BACK_BYTES):
            h.update(piece)
    return h.hexdigest()


class FileHash:
    """The blake3 of the ``size``-byte file at ``path``, fed with its bytes as they are written."""

    def __init__(self, path: str | os.PathLike[str], size: int, reorder_bytes: int = REORDER_BYTES) -> None:
        self.path = Path(path)
        self.size = size
        self.reorder_bytes = reorder_bytes
        self._hash = blake3.blake3()
        self._lock = threading.Lock()
        self._next = 0  # every byte before it is hashed
        self._hashing = False  # a thread is feeding the hash (outside the lock)
        self._waiting: dict[int, tuple[int, bytes | None]] = {}  # offset -> (length, copy or None: in the file)
        self._held = 0  # bytes of the copies in _waiting
        self._read_backs = 0
        self._failed = False  # hashing raised part-way: the digest is unusable

    @property
    def hashed_bytes(self) -> int:
        with self._lock:
            return self._next

    @property
    def read_back_bytes(self) -> int:
        """Bytes hashed from the file rather than from the writer's buffers."""
        with self._lock:
            return self._read_backs

    def add(self, offset: int, data: Bytes | None = None, length: int | None = None) -> None:
        view = None if data is None else memoryview(data).cast("B")
        n = len(view) if view is not None else length
        if n is None or n < 0 or (view is not None and length not in (None, n)):
            raise ValueError(f"{self.path}: add() needs data or a length, not both")
        if n == 0:
            return
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + n}) lie outside the {self.size}-byte file")
        with self._lock:
            if offset < self._next or offset in self._waiting:
                raise ValueError(f"{self.path}: bytes at {offset} were added twice")
            if self._hashing or offset != self._next:  # not our turn: leave the piece for the one hashing
                kept = bytes(view) if view is not None and self._held + n <= self.reorder_bytes else None
                self._waiting[offset] = (n, kept)
                self._held += n if kept is not None else 0
                return
            self._hashing = True
        self._hash_in_turn(offset, n, view)

    def hexdigest(self) -> str:
        """The file's blake3; ValueError if some of its bytes were never added."""
        with self._lock:
            if self._failed:
                raise ValueError(f"{self.path}: hashing failed part-way, so there is no digest")
            if self._hashing or self._next != self.size:
                waiting = ", ".join(str(o) for o in sorted(self._waiting)[:3])
                raise ValueError(
                    f"{self.path}: hashed {self._next} of {self.size} bytes (pieces waiting at: {waiting or 'none'})"
                )
            return self._hash.hexdigest()

    def _hash_in_turn(self, offset: int, n: int, view: memoryview | None) -> None:
        """Hash the piece at ``offset`` (the next one), then every waiting piece that follows it."""
        try:
            while True:
                if view is not None:
                    self._hash.update(view)
                else:
                    self._read_back(offset, n)
                with self._lock:
                    self._next = offset = offset + n
                    waiting = self._waiting.pop(offset, None)
                    if waiting is None:
                        self._hashing = False
                        return
                    n, copy = waiting
                    self._held -= len(copy) if copy is not None else 0
                view = None if copy is None else memoryview(copy)
        except BaseException:
            with self._lock:
                self._hashing, self._failed = False, True  # hexdigest() refuses it
            raise

    def _read_back(self, offset: int, n: int) -> None:
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            end = offset + n
            while offset < end:
                chunk = os.pread(fd, min(READ_BACK_BYTES, end - offset), offset)
                if not chunk:
                    raise ValueError(f"{self.path}: ends at {offset}, before bytes the writer reported written")
                self._hash.update(chunk)
                offset += len(chunk)
        finally:
            os.close(fd)
        with self._lock:
            self._read_backs += n

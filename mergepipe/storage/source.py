"""Where checkpoint bytes come from: exact byte ranges, every byte counted.

``RangeSource`` is the small interface everything above reads through:
the size of a file, and a read of ``[begin, end)`` into a caller's buffer,
tagged with the model it is for. Its counters are the ground truth for every
I/O number MergePipe reports (realized expert bytes, the budget guarantee,
manifests, benchmarks). ``LocalFileSource`` implements it for local files;
``remote_source.RemoteSource`` for objects in S3 or behind HTTP (ranged GETs
through fsspec), and ``remote_source.CheckpointSource``, which analysis and
the engine open, routes each read to one or the other by its path.

Why not the safetensors library's own loader: ``safe_open`` memory-maps the
file and materialises whole tensors (or slices) through page faults, so the
bytes that actually leave the disk are neither chosen nor countable, and
read-ahead makes them larger than asked. Here every read is one explicit
``preadv`` of an exact range into a caller-owned buffer.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Generator, Iterable, Protocol, TypeVar

import blake3
import numpy as np

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.location import Location

#: A writable buffer a read fills: the read-ahead's and analysis's are numpy arrays (typed apart: numpy declares
#: them buffers only for Python >= 3.12).
Buffer = bytearray | memoryview | np.ndarray

#: The paths a source reads: ``Path`` (local files), ``RemotePath``, or either (``Location``).
PathT = TypeVar("PathT", contravariant=True)


class RangeSource(Protocol[PathT]):
    """What readers of checkpoints need from storage (see the module docstring)."""

    def size(self, path: PathT) -> int: ...

    def read(
        self, path: PathT, begin: int, end: int, out: Buffer | None = None, tag: str | None = None
    ) -> memoryview: ...

    def advise_random(self, path: PathT) -> None: ...

    @property
    def bytes_read(self) -> int: ...

    def bytes_by_tag(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class ReadCounter:
    """Bytes read, in all and per tag, safe to update from several threads: the counts every source
    keeps (a source's counters are the ground truth of every I/O figure, module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tag: dict[str, int] = defaultdict(int)
        self._total = 0

    def add(self, nbytes: int, tag: str | None) -> None:
        with self._lock:
            self._total += nbytes
            if tag is not None:
                self._by_tag[tag] += nbytes

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def by_tag(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_tag)


class LocalFileSource:
    """Reads exact byte ranges of local files and counts every byte.

    One source per execution. Safe to use from several threads (a read-ahead
    pool): file descriptors are guarded by a lock, counts by a ``ReadCounter``, and the
    reads themselves are positional, so threads never share a file offset.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._counter = ReadCounter()
        self._closed = False

    def __enter__(self) -> LocalFileSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def size(self, path: Path) -> int:
        """Current size of ``path`` in bytes."""
        return os.fstat(self._fd(os.fspath(path))).st_size

    def read(
        self,
        path: Path,
        begin: int,
        end: int,
        out: Buffer | None = None,
        tag: str | None = None,
    ) -> memoryview:
        """Read bytes ``[begin, end)`` of ``path``; return them as a memoryview.

        With ``out`` the bytes land in its first ``end - begin`` bytes (no
        allocation) and the returned view is that prefix of ``out``. A file
        that ends before ``end`` raises ``CorruptCheckpointError``.
        """
        if begin < 0 or end < begin:
            raise ValueError(f"invalid byte range [{begin}, {end}) of {path}")
        length = end - begin
        view = _target(out, length)
        if length == 0:
            return view
        key = os.fspath(path)
        fd = self._fd(key)
        done = 0
        while done < length:
            got = os.preadv(fd, [view[done:]], begin + done)
            if got == 0:
                raise CorruptCheckpointError(
                    f"{key} is truncated: it ends at byte {begin + done}, before {end}; re-download or re-export it"
                )
            done += got
        self._counter.add(length, tag)
        return view

    def advise_random(self, path: Path) -> None:
        """Tell the kernel reads of ``path`` are sparse: no readahead.

        A budgeted merge reads scattered blocks of each expert; the default
        readahead would pull neighbouring, unplanned bytes from disk, so the
        physical expert I/O would exceed what was planned. Where the OS has
        no ``posix_fadvise`` this is a no-op.
        """
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(os.fspath(path)), 0, 0, os.POSIX_FADV_RANDOM)

    def _fd(self, key: str) -> int:
        with self._lock:
            if self._closed:
                raise ValueError("read from a closed LocalFileSource")
            fd = self._fds.get(key)
            if fd is None:
                try:
                    fd = os.open(key, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise CheckpointError(f"{key} disappeared; re-register the model if its files moved") from None
                except OSError as exc:
                    raise CheckpointError(f"cannot open {key}: {exc.strerror}") from None
                self._fds[key] = fd
            return fd

    @property
    def bytes_read(self) -> int:
        """Total bytes read by this source."""
        return self._counter.total

    def bytes_by_tag(self) -> dict[str, int]:
        """Bytes per tag; reads made without a tag appear only in the totals."""
        return self._counter.by_tag()

    def close(self) -> None:
        """Close every file descriptor; idempotent. Counters stay readable."""
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def _target(out: Buffer | None, length: int) -> memoryview:
    """The writable view ``read`` fills: a new buffer, or the prefix of ``out``."""
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
    """One positional read: ``[begin, end)`` of ``path``, counted under ``tag``.

    ``tensor`` and ``checks`` say what the bytes must be, for readers that
    verify them (the engine checks every block against the catalog's hash).
    """

    path: Location
    begin: int
    end: int
    tag: str
    tensor: str = ""
    checks: tuple[BlockCheck, ...] = ()
    kind: str = "block"  # what the checks cover: "block" (of a checkpoint) or "chunk" (of a delta store)

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
    """Reusable read buffers (uninitialised bytes), best fit by size.

    At most ``keep_bytes`` of free buffers are kept; beyond that the smallest
    are dropped, so the pool never holds more than the window it serves. The
    free buffers are kept sorted by size (a merge through delta stores frees
    hundreds of small ones), so a best fit is one bisection.
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._sizes: list[int] = []  # ``_free``'s sizes, ascending
        self._held = 0  # their sum
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


class Fetched:
    """An item with its bytes: ``views[i]`` holds ``item.reads[i]``; ``result``
    is what ``on_read`` returned (or None). ``release()`` hands the buffers
    back; the views must not be used after it."""

    def __init__(
        self,
        item: WorkItem,
        buffers: list[np.ndarray],
        views: list[memoryview],
        result: Any,
        on_release: Callable[[WorkItem, list[np.ndarray]], None],
    ) -> None:
        self.item = item
        self.views = views
        self.result = result
        self._buffers: list[np.ndarray] | None = buffers  # None once released
        self._on_release = on_release

    def release(self) -> None:
        """Return the buffers to the pool and the bytes to the window; idempotent."""
        buffers, self._buffers = self._buffers, None
        if buffers is not None:
            self._on_release(self.item, buffers)


class ReadAhead:
    """Runs the reads of upcoming work items ahead of their consumption."""

    def __init__(
        self,
        source: RangeSource[Location],
        threads: int,
        window_bytes: int,
        on_read: Callable[[WorkItem, list[memoryview]], Any] | None = None,
    ) -> None:
        self.source = source
        self.threads = max(1, threads)
        self.window_bytes = max(1, window_bytes)
        self.on_read = on_read
        self.pool = BufferPool(self.window_bytes)
        self._inflight = 0
        self._lock = threading.Lock()
        #: Seconds the reading threads spent reading and checking (``on_read``) items, summed over threads, and
        #: the bytes they read.
        self.read_seconds = 0.0
        self.read_bytes = 0

    def _fetch(self, item: WorkItem) -> Fetched:
        started = time.perf_counter()
        buffers = [self.pool.get(r.nbytes) for r in item.reads]
        views = [self.source.read(r.path, r.begin, r.end, out=b, tag=r.tag) for r, b in zip(item.reads, buffers)]
        result = self.on_read(item, views) if self.on_read is not None else None
        with self._lock:
            self.read_seconds += time.perf_counter() - started
            self.read_bytes += item.nbytes
        return Fetched(item, buffers, views, result, self._release)

    def _release(self, item: WorkItem, buffers: list[np.ndarray]) -> None:
        for buf in buffers:
            self.pool.put(buf)
        with self._lock:
            self._inflight -= item.nbytes

    def run(self, items: Iterable[WorkItem]) -> Generator[Fetched, None, None]:
        """Yield each item, in the order given, once its reads are done.

        The caller releases each ``Fetched`` when done with its bytes (items
        without reads need no release). Stopping early cancels what is queued.
        """
        pending: deque[tuple[WorkItem, Future | None]] = deque()
        source = iter(items)
        upcoming = next(source, None)
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="mergepipe-read") as pool:
            try:
                while True:
                    while upcoming is not None and (not pending or self._fits(upcoming)):
                        pending.append((upcoming, self._submit(pool, upcoming)))
                        upcoming = next(source, None)
                    if not pending:
                        return
                    item, future = pending.popleft()
                    yield future.result() if future is not None else Fetched(item, [], [], None, lambda *_: None)
            finally:
                for _, future in pending:
                    if future is not None:
                        future.cancel()

    def _fits(self, item: WorkItem) -> bool:
        """Whether ``item``'s reads fit in the window next to what is held (an
        item bigger than the window fits only when nothing else is held)."""
        with self._lock:
            return self._inflight == 0 or self._inflight + item.nbytes <= self.window_bytes

    def _submit(self, pool: ThreadPoolExecutor, item: WorkItem) -> Future | None:
        if not item.reads:
            return None
        with self._lock:
            self._inflight += item.nbytes
        return pool.submit(self._fetch, item)


#: Out-of-order bytes one file's hash keeps in memory while earlier bytes are still being made: enough for a
#: few blocks from each concurrent unit; beyond it only their places are kept and the bytes are read back.
REORDER_BYTES = 64 * 1024 * 1024
#: Bytes read back per positional read when hashing from the file.
READ_BACK_BYTES = 8 * 1024 * 1024
#: The file hash ``FileHash`` computes and new manifests record (since manifest schema 2).
FILE_HASH = "blake3"
#: The file hashes a manifest can record: ``FILE_HASH``, and sha256 before schema 2.
FILE_HASHES = (FILE_HASH, "sha256")

Bytes = bytes | bytearray | memoryview


def block_digest(data: bytes | bytearray | memoryview) -> str:
    """blake3 hex digest of ``data``."""
    return blake3.blake3(data).hexdigest()


def file_digest(path: str | os.PathLike[str] | int, algorithm: str = FILE_HASH) -> str:
    """Hex digest (``algorithm``: one of ``FILE_HASHES``) of the file at ``path``, or open as the descriptor
    ``path`` (closed after), read in large pieces."""
    if algorithm not in FILE_HASHES:
        raise ValueError(f"unknown file hash {algorithm!r}; known: {', '.join(FILE_HASHES)}")
    h = blake3.blake3() if algorithm == FILE_HASH else hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(READ_BACK_BYTES):
            h.update(piece)
    return h.hexdigest()


class FileHash:
    """The blake3 of the ``size``-byte file at ``path``, fed with its bytes as they are written.

    ``add(offset, data)`` after ``data`` is in the file at ``offset`` (or ``add(offset, length=n)`` for bytes
    that are only in the file, such as a header written elsewhere). Safe from any number of threads; every
    byte must be added exactly once (``ShardWriter`` guarantees it for the data, the caller for the header).
    Only one thread hashes at a time, in file order; the others leave their pieces and go on.
    """

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
        """Bytes hashed so far (a prefix of the file)."""
        with self._lock:
            return self._next

    @property
    def read_back_bytes(self) -> int:
        """Bytes hashed from the file rather than from the writer's buffers."""
        with self._lock:
            return self._read_backs

    def add(self, offset: int, data: Bytes | None = None, length: int | None = None) -> None:
        """Bytes ``[offset, offset + len)`` are in the file: ``data`` when given, else ``length`` bytes
        there. Hashed now if they come next, else kept (a copy, or their place) until their turn."""
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

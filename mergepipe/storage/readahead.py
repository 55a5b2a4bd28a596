"""Read-ahead: the reads of upcoming work run on a small thread pool while the
caller computes on earlier ones, into pooled buffers, within a memory window.

Analysis and the engine both walk a fixed list of work items in order; each
item names the byte ranges it needs (``ByteRange``). ``ReadAhead.run``
submits items' reads as soon as the window allows and yields each item,
in order, as a ``Fetched`` holding one buffer view per range. Positional
reads and blake3 release the GIL, so reading (and an optional ``on_read``
step, e.g. hashing, on the reading thread) overlaps torch math even on two
cores.

The reading threads' own time is counted (``read_seconds``, for ``read_bytes``): what reading and checking
a byte costs here, whatever the caller does beside it (analysis records it as this machine's read rate).

The window bounds the bytes held by items submitted but not yet released;
it never holds fewer than one item, so an item larger than the window (a
whole tensor) still runs, alone. Buffers come from a ``BufferPool`` and go
back to it on ``Fetched.release()``: no fresh, zero-filled allocation per
read.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable

import numpy as np

from mergepipe.storage.location import Location
from mergepipe.storage.source import RangeSource


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

    def __init__(self, item: WorkItem, buffers: list[np.ndarray], views: list[memoryview], result: Any,
                 on_release: Callable[[WorkItem, list[np.ndarray]], None]) -> None:
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

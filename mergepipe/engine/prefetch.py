"""Read-ahead: positional reads on a small thread pool, consumed in order.

The engine walks a shard's work items in output order. Items that need
bytes from disk are handed to a thread pool as soon as the in-flight window
allows, so reads overlap the operator math of earlier items (``os.preadv``
releases the GIL). The window bounds the bytes held by reads not yet
consumed; it never holds fewer than one item, so an item larger than the
window (a tensor-level tensor) still runs, alone.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from mergepipe.storage.reader import BlockReader


@dataclass(frozen=True)
class ByteRange:
    """One positional read: ``[begin, end)`` of ``path``, counted under ``tag``."""

    path: Path
    begin: int
    end: int
    tag: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class WorkItem:
    """Something the engine does in output order, with the reads it needs."""

    payload: Any
    reads: list[ByteRange] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


class Prefetcher:
    """Runs the reads of upcoming work items ahead of their consumption."""

    def __init__(self, reader: BlockReader, threads: int, window_bytes: int) -> None:
        self.reader = reader
        self.threads = max(1, threads)
        self.window_bytes = max(1, window_bytes)
        self.peak_inflight_bytes = 0

    def _read_all(self, reads: list[ByteRange]) -> list[memoryview]:
        return [self.reader.read(r.path, r.begin, r.end, tag=r.tag) for r in reads]

    def run(self, items: Iterable[WorkItem]) -> Iterator[tuple[WorkItem, list[memoryview]]]:
        """Yield each item with its read buffers, in the order given."""
        pending: deque[tuple[WorkItem, Future | None]] = deque()
        inflight = 0
        source = iter(items)
        exhausted = False
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="mergepipe-read") as pool:
            try:
                while True:
                    while not exhausted and (not pending or inflight < self.window_bytes):
                        item = next(source, None)
                        if item is None:
                            exhausted = True
                            break
                        future = pool.submit(self._read_all, item.reads) if item.reads else None
                        pending.append((item, future))
                        inflight += item.nbytes
                        self.peak_inflight_bytes = max(self.peak_inflight_bytes, inflight)
                    if not pending:
                        return
                    item, future = pending.popleft()
                    buffers = future.result() if future is not None else []
                    inflight -= item.nbytes
                    yield item, buffers
            finally:
                for _, future in pending:
                    if future is not None:
                        future.cancel()

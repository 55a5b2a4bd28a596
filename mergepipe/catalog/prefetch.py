"""Read whole tensors ahead of the computation, hashing their blocks on the way.

A background thread reads each scheduled tensor with one positional read
(through the caller's ``BlockReader``, so every byte is counted) into a
pooled buffer, hashes its blocks with blake3 from that same buffer, and hands
it over through a small queue; the consumer computes on one tensor while the
next is being read. File reads and blake3 release the GIL, so this overlaps
I/O and hashing with torch work even on two cores.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import blake3
import numpy as np

from mergepipe.catalog.records import BlockRecord, TensorRecord
from mergepipe.storage.reader import BlockReader

#: How many tensors the reading thread may run ahead of the computing one:
#: enough to overlap I/O and hashing with compute, little enough to bound memory.
PREFETCH_TENSORS = 2


class TensorRead(Protocol):
    """What to read: ``tensor`` of the model at ``path``, tagged ``model_id``."""

    model_id: str
    tensor: TensorRecord
    path: Path
    blocks: list[BlockRecord]
    needs_hash: bool


class BufferPool:
    """Reusable read buffers (uninitialised numpy bytes), best fit by size."""

    _KEEP = 2 * PREFETCH_TENSORS + 2

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def put(self, buf: np.ndarray | None) -> None:
        if buf is None:
            return
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._KEEP:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


_DONE = object()


def hash_blocks(view: memoryview, t: TensorRecord, blocks: list[BlockRecord]) -> list[str]:
    # Single-threaded blake3 runs at several GB/s per core, above what the
    # statistics sustain, so the second core is better spent on torch.
    return [blake3.blake3(view[b.begin - t.begin : b.end - t.begin]).hexdigest() for b in blocks]


def prefetch_reads(
    schedule: Sequence[TensorRead], reader: BlockReader, pool: BufferPool, stop: threading.Event
) -> Iterator[tuple[TensorRead, memoryview, np.ndarray, list[str] | None]]:
    """Yield (read, bytes, buffer, new hashes) with a thread reading and
    hashing up to ``PREFETCH_TENSORS`` tensors ahead."""
    out: queue.Queue = queue.Queue(maxsize=PREFETCH_TENSORS)

    def produce() -> None:
        try:
            for item in schedule:
                if stop.is_set():
                    return
                t = item.tensor
                buf = pool.get(t.nbytes)
                view = reader.read(item.path / t.file, t.begin, t.end, out=buf, tag=item.model_id)
                hashes = hash_blocks(view, t, item.blocks) if item.needs_hash else None
                out.put((item, view, buf, hashes))
            out.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            out.put(exc)

    worker = threading.Thread(target=produce, name="mergepipe-analyze-read", daemon=True)
    worker.start()
    try:
        while True:
            got = out.get()
            if got is _DONE:
                return
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue
            try:
                out.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()

"""Write-behind: output writes done on a thread of their own, in order, while the producer goes on.

A merge worker alternates computing a block and writing it (a copy into the
page cache, the streamed file hash, starting its write-back). Done on one
thread, the writing is added to the computing; here the worker queues each
write and computes the next block while a writer thread does it. Positional
writes and blake3 release the GIL, so the two overlap on two cores.

The queue holds at most ``max_bytes`` (never fewer than one write, however
large), so a producer faster than the disk waits instead of growing memory.
A write's ``done`` callback runs after it (e.g. to hand a read buffer back).
Other work that writes may be queued in the same order (``call``: a range
the kernel copies into the file, read back and hashed), holding no bytes.
The first failure is raised to the producer at its next ``write`` or at
``close``; nothing after it is written, and every ``done`` still runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from types import TracebackType

from mergepipe.storage.writer import ShardWriter

#: Bytes queued behind the producer: enough that a run of copied blocks (pure I/O, queued at once) does not
#: stop the producer from reaching the next block to merge; copied blocks are read buffers held anyway.
DEFAULT_QUEUE_BYTES = 128 * 1024 * 1024

#: (the work, the bytes it holds in the queue, what runs after it)
_Job = tuple[Callable[[], object], int, Callable[[], None] | None]


class WriteBehind:
    """Writes ``ShardWriter.write`` calls on one background thread, in the order they were queued."""

    def __init__(self, max_bytes: int = DEFAULT_QUEUE_BYTES, name: str = "mergepipe-write") -> None:
        self.max_bytes = max(1, max_bytes)
        self._jobs: deque[_Job] = deque()
        self._queued = 0
        self._busy = False
        self._closed = False
        self._abandoned = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        #: seconds the writer thread spent writing (and hashing); seconds the producer waited for room
        self.write_seconds = 0.0
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
        else:
            self.abandon()

    def write(self, writer: ShardWriter, name: str, offset: int, data: bytes | bytearray | memoryview,
              done: Callable[[], None] | None = None) -> None:
        """Queue ``writer.write(name, offset, data)``, then ``done()``; ``data`` must stay unchanged until
        ``done`` runs. Waits while the queue is full; raises the first failure of an earlier write."""
        view = memoryview(data).cast("B")
        self._queue((partial(writer.write, name, offset, view), len(view), done))

    def call(self, work: Callable[[], object]) -> None:
        """Queue ``work()`` after the writes queued before it (it holds no bytes in the queue); raises the
        first failure of an earlier job."""
        self._queue((work, 0, None))

    def _queue(self, job: _Job) -> None:
        nbytes, done = job[1], job[2]
        started = time.perf_counter()
        with self._changed:
            while self._error is None and self._queued and self._queued + nbytes > self.max_bytes:
                self._changed.wait()
            self.wait_seconds += time.perf_counter() - started
            if self._error is not None or self._closed:
                if done is not None:
                    done()
                self._raise()
                raise ValueError("write after the write-behind queue was closed")
            self._jobs.append(job)
            self._queued += nbytes
            self._changed.notify_all()

    def close(self) -> None:
        """Wait until every queued write is done; raise the first failure. Idempotent."""
        started = time.perf_counter()
        with self._changed:
            while self._error is None and (self._jobs or self._busy):
                self._changed.wait()
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        self.wait_seconds += time.perf_counter() - started
        self._drop_queued()
        self._raise()

    def abandon(self) -> None:
        """Stop after the write in progress, without writing what is queued (the output is discarded)."""
        with self._changed:
            self._closed = self._abandoned = True
            self._changed.notify_all()
        self._thread.join()
        self._drop_queued()

    # -- the writer thread ------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._jobs and not self._closed:
                    self._changed.wait()
                if not self._jobs or self._error is not None or self._abandoned:
                    return
                job = self._jobs.popleft()
                self._busy = True
            self._do(job)

    def _do(self, job: _Job) -> None:
        work, nbytes, done = job
        started = time.perf_counter()
        error = _attempt(work)
        released = _attempt(done) if done is not None else None  # runs whether the write failed or not
        error = error or released
        with self._changed:
            self.write_seconds += time.perf_counter() - started
            self._queued -= nbytes
            self._busy = False
            if error is not None and self._error is None:
                self._error = error
            self._changed.notify_all()

    def _drop_queued(self) -> None:
        with self._changed:
            jobs, self._jobs = list(self._jobs), deque()
            self._queued = 0
        for *_, done in jobs:
            if done is not None:
                done()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def _attempt(function: Callable[..., object], *args: object) -> BaseException | None:
    """Run ``function(*args)`` on the writer thread; what it raised, for the producer to raise."""
    try:
        function(*args)
    except BaseException as exc:  # handed over, never swallowed: the producer raises it
        return exc
    return None

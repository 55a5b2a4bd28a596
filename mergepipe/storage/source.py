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

import os
import threading
from collections import defaultdict
from pathlib import Path
from types import TracebackType
from typing import Protocol, TypeVar

import numpy as np

from mergepipe.errors import CheckpointError, CorruptCheckpointError

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
                    f"{key} is truncated: it ends at byte {begin + done}, before {end}; "
                    "re-download or re-export it"
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
                    raise CheckpointError(
                        f"{key} disappeared; re-register the model if its files moved"
                    ) from None
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

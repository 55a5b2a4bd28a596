"""A safetensors writer that streams data block by block.

The safetensors library serialises a complete in-memory dict of tensors, so
writing a multi-GB shard with it means holding the whole shard in memory.
Here the header is written first (every tensor's size is known from the
plan), the file is preallocated, and data arrives block by block, in any
order, through positional writes; unchanged tensors can be copied
file-to-file by the kernel without passing through Python.

The writer never finalises a file after an error: ``close`` refuses (and
removes the file) unless every byte of every tensor was written exactly once
and no write failed, and the context manager aborts on any exception.
"""

from __future__ import annotations

import bisect
import errno
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from mergepipe.errors import CorruptCheckpointError
from mergepipe.storage.format import (
    DTYPE_SIZES,
    HEADER_ALIGNMENT,
    HEADER_PREFIX_BYTES,
    MAX_HEADER_BYTES,
    METADATA_KEY,
)

# Chunk of the read/write fallback of copy_range: big enough to amortise
# syscalls, small enough to be irrelevant next to the engine's block buffers.
COPY_CHUNK_BYTES = 8 * 1024 * 1024

# Errors after which posix_fallocate is skipped (the filesystem cannot do it)
# and the file is only extended with ftruncate. ENOSPC is not among them: a
# disk too small for the output should fail before any data is written.
_FALLOCATE_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class _Slot:
    """Where one tensor's data goes: ``[begin, end)`` relative to the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class _Coverage:
    """Disjoint written byte ranges of one tensor, merged when adjacent."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.covered = 0

    def reserve(self, start: int, end: int) -> bool:
        """Record ``[start, end)``; False (and nothing recorded) if it overlaps."""
        if start == end:
            return True
        i = bisect.bisect_right(self.starts, start)
        if i > 0 and self.ends[i - 1] > start:
            return False
        if i < len(self.starts) and self.starts[i] < end:
            return False
        merge_prev = i > 0 and self.ends[i - 1] == start
        merge_next = i < len(self.starts) and self.starts[i] == end
        if merge_prev and merge_next:
            self.ends[i - 1] = self.ends[i]
            del self.starts[i], self.ends[i]
        elif merge_prev:
            self.ends[i - 1] = end
        elif merge_next:
            self.starts[i] = start
        else:
            self.starts.insert(i, start)
            self.ends.insert(i, end)
        self.covered += end - start
        return True


class StreamingSafetensorsWriter:
    """Write one safetensors file: header at construction, data block by block.

    ``entries`` are ``(name, dtype, shape)`` in the order their data is laid
    out. The file is created exclusively (an existing file is never
    overwritten). Writes may come from several threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._slots = _layout(entries)
        header = _header_bytes(self._slots, metadata)
        self.header_len = len(header)
        self.data_start = HEADER_PREFIX_BYTES + self.header_len
        data_len = max((s.end for s in self._slots.values()), default=0)
        self.file_size = self.data_start + data_len
        self._coverage = {name: _Coverage() for name in self._slots}
        self._lock = threading.Lock()
        self._bytes_written = 0
        self._bytes_copied = 0
        self._use_copy_file_range = hasattr(os, "copy_file_range")
        self._failed = False
        self._state = "open"  # open -> closed | aborted
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            self._preallocate()
            prefix = self.header_len.to_bytes(HEADER_PREFIX_BYTES, "little")
            self._pwrite_all(memoryview(prefix + header), 0)
        except BaseException:
            self.abort()
            raise
        self._bytes_written = self.data_start

    # -- context manager -------------------------------------------------

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.close()

    # -- layout ----------------------------------------------------------

    def data_offset(self, name: str) -> int:
        """Absolute file offset of the first byte of tensor ``name``."""
        return self.data_start + self._slot(name).begin

    def tensor_nbytes(self, name: str) -> int:
        return self._slot(name).nbytes

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    @property
    def bytes_written(self) -> int:
        """Bytes put into the file so far: header plus data (copied bytes included)."""
        with self._lock:
            return self._bytes_written

    @property
    def bytes_copied(self) -> int:
        """The part of ``bytes_written`` that came through ``copy_range``."""
        with self._lock:
            return self._bytes_copied

    # -- data ------------------------------------------------------------

    def write(self, name: str, tensor_offset_bytes: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at byte ``tensor_offset_bytes`` of tensor ``name``'s data.

        Every byte of a tensor must be written exactly once: a range that
        overlaps an earlier write or leaves the tensor raises ``ValueError``.
        """
        view = memoryview(data).cast("B")
        absolute = self._reserve(name, tensor_offset_bytes, len(view))
        try:
            self._pwrite_all(view, absolute)
        except BaseException:
            self._failed = True
            raise
        with self._lock:
            self._bytes_written += len(view)

    def copy_range(
        self, name: str, tensor_offset_bytes: int, src_fd: int, src_offset: int, length: int
    ) -> int:
        """Copy ``length`` bytes at ``src_offset`` of ``src_fd`` into tensor ``name``.

        Uses ``os.copy_file_range`` (the kernel copies, possibly by reflink)
        and falls back to pread/pwrite where the filesystem refuses. Returns
        the bytes copied. These source reads bypass ``BlockReader`` and are
        counted nowhere but in ``bytes_copied``: the caller (the engine, for
        base tensors passed through) accounts for them itself. Never use this
        for expert bytes, which must go through the reader's budget counters.
        """
        absolute = self._reserve(name, tensor_offset_bytes, length)
        try:
            done = self._copy_kernel(src_fd, src_offset, absolute, length)
            done += self._copy_userspace(src_fd, src_offset + done, absolute + done, length - done)
        except BaseException:
            self._failed = True
            raise
        with self._lock:
            self._bytes_written += length
            self._bytes_copied += length
        return length

    def _copy_kernel(self, src_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
        done = 0
        while done < length and self._use_copy_file_range:
            try:
                got = os.copy_file_range(src_fd, self._fd, length - done, src_offset + done, dst_offset + done)
            except OSError:
                # EXDEV, ENOSYS, EINVAL, EOPNOTSUPP, ...: this filesystem pair
                # cannot do it; a real I/O error resurfaces in the fallback.
                self._use_copy_file_range = False
                break
            if got == 0:
                raise _truncated_source(src_offset + done, src_offset + length)
            done += got
        return done

    def _copy_userspace(self, src_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
        if length == 0:
            return 0
        buf = memoryview(bytearray(min(length, COPY_CHUNK_BYTES)))
        done = 0
        while done < length:
            chunk = buf[: min(len(buf), length - done)]
            got = os.preadv(src_fd, [chunk], src_offset + done)
            if got == 0:
                raise _truncated_source(src_offset + done, src_offset + length)
            self._pwrite_all(chunk[:got], dst_offset + done)
            done += got
        return done

    # -- finishing -------------------------------------------------------

    def close(self, fsync: bool = True) -> None:
        """Finalise the file: check every tensor is complete, fsync, close.

        If a write failed or any tensor is incomplete, the file is removed and
        ``ValueError`` is raised: a partial file is never left behind. The
        directory entry is not fsynced here; publishing does that.
        """
        if self._state == "closed":
            return
        if self._state == "aborted":
            raise ValueError(f"{self.path}: writer was aborted; it cannot be closed")
        if self._failed:
            self.abort()
            raise ValueError(f"{self.path}: a write failed, so the file was removed instead of finalised")
        with self._lock:
            missing = [
                (name, self._coverage[name].covered, slot.nbytes)
                for name, slot in self._slots.items()
                if self._coverage[name].covered != slot.nbytes
            ]
        if missing:
            self.abort()
            name, covered, total = missing[0]
            raise ValueError(
                f"{self.path}: {len(missing)} tensor(s) not fully written "
                f"(first: {name!r}, {covered} of {total} bytes); the file was removed"
            )
        if fsync:
            try:
                os.fsync(self._fd)
            except BaseException:
                self.abort()
                raise
        self._state = "closed"
        os.close(self._fd)

    def abort(self) -> None:
        """Close and delete the partial file; idempotent."""
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            os.close(self._fd)
        finally:
            self.path.unlink(missing_ok=True)

    # -- internals -------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor {name!r} in this file's header") from None

    def _reserve(self, name: str, offset: int, length: int) -> int:
        """Check and record that ``[offset, offset+length)`` of ``name`` is written once."""
        slot = self._slot(name)
        if self._state != "open":
            raise ValueError(f"{self.path}: write after the writer was {self._state}")
        if offset < 0 or length < 0 or offset + length > slot.nbytes:
            raise ValueError(
                f"{self.path}: bytes [{offset}, {offset + length}) are outside tensor {name!r} "
                f"({slot.nbytes} bytes)"
            )
        with self._lock:
            if not self._coverage[name].reserve(offset, offset + length):
                raise ValueError(
                    f"{self.path}: bytes [{offset}, {offset + length}) of tensor {name!r} "
                    "overlap bytes already written"
                )
        return self.data_start + slot.begin + offset

    def _preallocate(self) -> None:
        if self.file_size > 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(self._fd, 0, self.file_size)
            except OSError as exc:
                if exc.errno not in _FALLOCATE_UNSUPPORTED:
                    raise
        os.ftruncate(self._fd, self.file_size)

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)


def _layout(entries: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, _Slot]:
    slots: dict[str, _Slot] = {}
    offset = 0
    for name, dtype, shape in entries:
        if not isinstance(name, str) or name == METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}")
        if name in slots:
            raise ValueError(f"tensor {name!r} listed twice")
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        shape = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not non-negative integers")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        slots[name] = _Slot(dtype, shape, offset, offset + nbytes)
        offset += nbytes
    return slots


def _header_bytes(slots: dict[str, _Slot], metadata: dict[str, str] | None) -> bytes:
    doc: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        doc[METADATA_KEY] = dict(metadata)
    for name, slot in slots.items():
        doc[name] = {"dtype": slot.dtype, "shape": list(slot.shape), "data_offsets": [slot.begin, slot.end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(HEADER_PREFIX_BYTES + len(raw)) % HEADER_ALIGNMENT)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    return raw


def _truncated_source(at: int, wanted_end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"source file ended at byte {at} while copying up to byte {wanted_end}; "
        "re-download or re-export the input checkpoint"
    )

"""Writing safetensors files block by block, at fixed offsets, from any worker.

The safetensors library serialises a complete in-memory dict of tensors, so
writing a multi-GB shard with it means holding the whole shard in memory.
Here a shard is written in two steps:

1. ``create_shard`` (the coordinator) writes the header (every tensor's size
   is known from the plan) and preallocates the file, so every tensor's
   bytes have a fixed offset (``ShardLayout``);
2. ``ShardWriter`` (any worker, any process) opens the file and writes the
   bytes of the tensors it owns, block by block, in any order, through
   positional writes.

A writer may feed a ``FileHash`` (``hashing.py``) with every range right
after it is written, so the file's hash is known when the last byte is
(the header, written by ``create_shard``, is the caller's to add). Each
range's write-back to disk is started as it is written (Linux
``sync_file_range``), so the disk writes while the merge computes and the
publisher's fsync finds little left to do. A range may also be copied in
from another file by the kernel (``ShardWriter.copy_from``: an incremental
merge's reused bytes), then read back once, for the caller's check and the
hash. ``shard_header`` says what ``create_shard`` would write first, so a
file that already has exactly those bytes can be recognised.

A writer checks that every byte of its tensors is written exactly once:
``finish`` refuses a tensor left incomplete, and a failed write marks the
writer failed. Nothing here finalises anything: the caller publishes the
whole staging directory only when every writer finished, and removes it
otherwise.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import functools
import json
import math
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterable

import torch

from mergepipe.errors import CheckpointError
from mergepipe.storage.format import DTYPE_SIZES, HEADER_ALIGNMENT, HEADER_PREFIX_BYTES, MAX_HEADER_BYTES, METADATA_KEY
from mergepipe.storage.linking import copy_range
from mergepipe.storage.source import FileHash

_TORCH_DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}

# Resolved once: a dtype missing from this torch build is simply absent.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for st, name in _TORCH_DTYPE_NAMES.items() if hasattr(torch, name)
}

Buffer = bytes | bytearray | memoryview


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    try:
        return _TORCH_DTYPES[st_dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {st_dtype!r} is not supported by torch {torch.__version__}; "
            "upgrade torch or convert the checkpoint to F32/F16/BF16"
        ) from None


def _check_host() -> None:
    if sys.byteorder != "little":
        raise CheckpointError("safetensors data is little-endian; MergePipe needs a little-endian host")


def raw_view(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf`` as a tensor of its native dtype and ``shape``.

    Zero-copy for writable buffers: the tensor aliases ``buf``, so it is only
    valid while ``buf`` is neither reused nor freed. A read-only buffer
    (``bytes``) is copied once, because torch tensors must be writable.
    """
    _check_host()
    target = torch_dtype(dtype)
    view = memoryview(buf).cast("B")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if len(view) != expected:
        raise ValueError(f"{len(view)} bytes cannot hold {dtype} of shape {tuple(shape)} ({expected} bytes)")
    if expected == 0:
        return torch.empty(shape, dtype=target)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=target).reshape(shape)


def to_float32(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The values in ``buf`` as a new fp32 tensor of ``shape`` (exact for F16/BF16).

    The result owns its memory (even for F32 input), so the caller may reuse
    ``buf`` at once.
    """
    return raw_view(buf, dtype, shape).to(torch.float32, copy=True)


def to_bytes(t: torch.Tensor, dtype: str) -> memoryview:
    """The raw little-endian bytes of ``t`` cast to ``dtype``.

    The cast rounds to nearest even, as torch does; a tensor on a GPU is cast
    there and only the (often half-size) result copied back. A contiguous
    CPU tensor already in ``dtype`` is not copied: the returned view shares
    its memory and keeps it alive.
    """
    _check_host()
    target = torch_dtype(dtype)
    out = t.detach().to(dtype=target).to(device="cpu").contiguous()
    if out.numel() == 0:
        return memoryview(b"")
    return out.reshape(-1).view(torch.uint8).numpy().data


# Errors after which posix_fallocate is skipped (the filesystem cannot do it)
# and the file is only extended with ftruncate. ENOSPC is not among them: a
# disk too small for the output should fail before any data is written.
_FALLOCATE_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
#: ``sync_file_range`` flag: start write-out of the range's dirty pages, do not wait.
_SYNC_FILE_RANGE_WRITE = 2


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


@dataclass(frozen=True)
class ShardLayout:
    """Where every tensor of one created safetensors file lives: a file at ``path``, or, for a merge held
    in memory (``memory_shard``), ``buffer``, the file's bytes (``path`` then only names it in messages)."""

    path: Path
    data_start: int
    slots: dict[str, _Slot]
    buffer: bytearray | None = None

    @property
    def file_size(self) -> int:
        return self.data_start + max((s.end for s in self.slots.values()), default=0)

    def slot(self, name: str) -> _Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor {name!r} in this file's header") from None


def create_shard(
    path: str | os.PathLike[str],
    entries: list[tuple[str, str, tuple[int, ...]]],
    metadata: dict[str, str] | None = None,
) -> ShardLayout:
    """Create ``path`` exclusively with the header of ``entries`` (``(name, dtype,
    shape)`` in data order) and room for all their bytes; never overwrites.

    The file is preallocated, so a disk too small for it fails here, before
    any tensor is computed. The data section is left for ``ShardWriter``s.
    """
    path = Path(path)
    slots = _layout(entries)
    header = _header_bytes(slots, metadata)
    layout = ShardLayout(path, HEADER_PREFIX_BYTES + len(header), slots)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _preallocate(fd, layout.file_size)
        prefix = len(header).to_bytes(HEADER_PREFIX_BYTES, "little")
        _pwrite_all(fd, memoryview(prefix + header), 0)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return layout


def shard_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, int]:
    """What ``create_shard`` writes first for ``entries`` and ``metadata`` (the length prefix and the padded
    header: every tensor's name, dtype, shape and offsets), and the size of the file it makes."""
    slots = _layout(entries)
    header = _header_bytes(slots, metadata)
    return len(header).to_bytes(HEADER_PREFIX_BYTES, "little") + header, HEADER_PREFIX_BYTES + len(header) + max(
        (s.end for s in slots.values()), default=0
    )


def has_header(fd: int, header: bytes) -> bool:
    """Whether the file open as ``fd`` starts with ``header`` (``shard_header``'s bytes): its length prefix
    included, so the whole header is the same, byte for byte."""
    return os.pread(fd, len(header), 0) == header


def memory_shard(
    name: str,
    entries: list[tuple[str, str, tuple[int, ...]]],
    metadata: dict[str, str] | None = None,
) -> ShardLayout:
    """``create_shard`` into memory: a buffer holding the header of ``entries`` and room for their bytes,
    for ``ShardWriter``s to fill. The buffer is then the file ``create_shard`` would have written, byte for
    byte, and ``tensors`` views it without a copy (an evaluation's model, ``engine/in_memory.py``)."""
    slots = _layout(entries)
    header = _header_bytes(slots, metadata)
    layout = ShardLayout(Path(name), HEADER_PREFIX_BYTES + len(header), slots, bytearray())
    assert layout.buffer is not None
    layout.buffer.extend(len(header).to_bytes(HEADER_PREFIX_BYTES, "little") + header)
    layout.buffer.extend(bytes(layout.file_size - layout.data_start))
    return layout


def tensors(layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Each tensor of a filled ``memory_shard``, viewing its buffer (no copy)."""
    assert layout.buffer is not None
    views = {}
    for name, slot in layout.slots.items():
        dtype = torch_dtype(slot.dtype)
        count = slot.nbytes // DTYPE_SIZES[slot.dtype]
        flat = (
            torch.frombuffer(layout.buffer, dtype=dtype, count=count, offset=layout.data_start + slot.begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        views[name] = flat.view(slot.shape)
    return views


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


class ShardWriter:
    """Positional writes into some tensors of a created shard (all of them by default).

    Safe to use from several threads. Every byte of each of its tensors must
    be written exactly once: a range that overlaps an earlier write or leaves
    the tensor raises ``ValueError``, and ``finish`` checks completeness.
    Each range written is then added to ``hasher`` (the file's streamed
    hash, shared by every writer of the file), when one is given.
    """

    def __init__(
        self, layout: ShardLayout, tensors: Iterable[str] | None = None, hasher: FileHash | None = None
    ) -> None:
        self.layout = layout
        self.hasher = hasher
        names = list(layout.slots) if tensors is None else list(tensors)
        for name in names:
            layout.slot(name)
        self._coverage = {name: _Coverage() for name in names}
        self._lock = threading.Lock()
        self._bytes_written = 0
        self._failed = False
        self._closed = False
        # read and write: bytes copied in are read back for their check and the hash (``copy_from``)
        self._fd: int | None = (
            None if layout.buffer is not None else os.open(layout.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        )

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def bytes_written(self) -> int:
        """Data bytes put into the file so far."""
        with self._lock:
            return self._bytes_written

    # -- data ------------------------------------------------------------

    def write(self, name: str, tensor_offset_bytes: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at byte ``tensor_offset_bytes`` of tensor ``name``'s data."""
        view = memoryview(data).cast("B")
        absolute = self._reserve(name, tensor_offset_bytes, len(view))
        try:
            if self.layout.buffer is not None:
                self.layout.buffer[absolute : absolute + len(view)] = view
            else:
                fd = self._open_fd()
                _pwrite_all(fd, view, absolute)
                start_writeback(fd, absolute, len(view))
            if self.hasher is not None:
                self.hasher.add(absolute, view)
        except BaseException:
            self._failed = True
            raise
        with self._lock:
            self._bytes_written += len(view)

    def copy_from(
        self,
        name: str,
        tensor_offset_bytes: int,
        source_fd: int,
        source_offset: int,
        length: int,
        check: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Copy ``length`` bytes at ``source_offset`` of the open file ``source_fd`` to byte
        ``tensor_offset_bytes`` of tensor ``name``'s data, in the kernel (``linking.copy_range``); then read
        them back once (from the page cache) for ``check``, which raises if they are not what they must be,
        and for the hasher. A shard held in memory is only ever written."""
        absolute = self._reserve(name, tensor_offset_bytes, length)
        try:
            if self.layout.buffer is not None:
                raise ValueError(f"{self.layout.path}: a shard held in memory cannot be copied into")
            fd = self._open_fd()
            copy_range(source_fd, fd, source_offset, absolute, length)
            start_writeback(fd, absolute, length)
            if check is not None or self.hasher is not None:
                data = memoryview(os.pread(fd, length, absolute))
                if len(data) != length:
                    raise ValueError(
                        f"{self.layout.path}: ends before bytes [{absolute}, {absolute + length}) just copied into it"
                    )
                if check is not None:
                    check(data)
                if self.hasher is not None:
                    self.hasher.add(absolute, data)
        except BaseException:
            self._failed = True
            raise
        with self._lock:
            self._bytes_written += length

    # -- finishing -------------------------------------------------------

    def finish(self) -> None:
        """Check every tensor of this writer is complete and no write failed; close.

        ``ValueError`` naming the first incomplete tensor otherwise. Durability
        is the publisher's job (it fsyncs the whole staging tree).
        """
        try:
            if self._failed:
                raise ValueError(f"{self.layout.path}: a write failed, so the file is not complete")
            with self._lock:
                missing = [
                    (name, cov.covered, self.layout.slots[name].nbytes)
                    for name, cov in self._coverage.items()
                    if cov.covered != self.layout.slots[name].nbytes
                ]
            if missing:
                name, covered, total = missing[0]
                raise ValueError(
                    f"{self.layout.path}: {len(missing)} tensor(s) not fully written "
                    f"(first: {name!r}, {covered} of {total} bytes)"
                )
        finally:
            self.close()

    def close(self) -> None:
        """Close the file descriptor; idempotent (no completeness check)."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # -- internals -------------------------------------------------------

    def _open_fd(self) -> int:
        if self._closed or self._fd is None:
            raise ValueError(f"{self.layout.path}: write after the writer was closed")
        return self._fd

    def _reserve(self, name: str, offset: int, length: int) -> int:
        """Check and record that ``[offset, offset+length)`` of ``name`` is written once."""
        slot = self.layout.slot(name)
        if name not in self._coverage:
            raise ValueError(f"{self.layout.path}: tensor {name!r} is not one this writer writes")
        if self._closed:
            raise ValueError(f"{self.layout.path}: write after the writer was closed")
        if offset < 0 or length < 0 or offset + length > slot.nbytes:
            raise ValueError(
                f"{self.layout.path}: bytes [{offset}, {offset + length}) are outside tensor {name!r} "
                f"({slot.nbytes} bytes)"
            )
        with self._lock:
            if not self._coverage[name].reserve(offset, offset + length):
                raise ValueError(
                    f"{self.layout.path}: bytes [{offset}, {offset + length}) of tensor {name!r} "
                    "overlap bytes already written"
                )
        return self.layout.data_start + slot.begin + offset


@functools.cache
def _sync_file_range() -> Callable[..., int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to disk, without waiting for it (nothing
    where the OS has no such call). Durability is still the fsync's: this only starts it early."""
    function = _sync_file_range()
    if function is not None and length > 0:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a failure only loses the head start


def _preallocate(fd: int, size: int) -> None:
    if size > 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in _FALLOCATE_UNSUPPORTED:
                raise
    os.ftruncate(fd, size)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.abandon()

    def write(
        self,
        writer: ShardWriter,
        name: str,
        offset: int,
        data: bytes | bytearray | memoryview,
        done: Callable[[], None] | None = None,
    ) -> None:
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

"""Output files: raw bytes <-> torch; safetensors shards created with their header and written block by block
from any worker; a write-behind thread; files placed by reflink or kernel copy; ``open_inside``.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import functools
import json
import math
import os
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Callable, Iterable

from mergepipe.errors import CheckpointError
from mergepipe.storage.format import (
    DTYPE_SIZES,
    DTYPES,
    HEADER_ALIGNMENT,
    HEADER_PREFIX_BYTES,
    MAX_HEADER_BYTES,
    METADATA_KEY,
)
from mergepipe.storage.source import FileHash

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview
Entries = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape) in data order


def torch_dtype(st_dtype: str) -> torch.dtype:
    import torch

    found = getattr(torch, DTYPES[st_dtype][1], None) if st_dtype in DTYPES else None
    if found is None:
        raise CheckpointError(
            f"dtype {st_dtype!r} is not supported by torch {torch.__version__}; "
            "upgrade torch or convert the checkpoint to F32/F16/BF16"
        )
    return found


def raw_view(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf`` as a tensor of its dtype and ``shape``, aliasing ``buf`` (a read-only one is copied)."""
    import torch

    if sys.byteorder != "little":
        raise CheckpointError("safetensors data is little-endian; MergePipe needs a little-endian host")
    target = torch_dtype(dtype)
    view = memoryview(buf).cast("B")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if len(view) != expected:
        raise ValueError(f"{len(view)} bytes cannot hold {dtype} of shape {tuple(shape)} ({expected} bytes)")
    if expected == 0:
        return torch.empty(shape, dtype=target)
    return torch.frombuffer(view if not view.readonly else bytearray(view), dtype=target).reshape(shape)


def to_float32(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The values in ``buf`` as a new fp32 tensor (exact for F16/BF16) owning its memory."""
    import torch

    return raw_view(buf, dtype, shape).to(torch.float32, copy=True)


def to_bytes(t: torch.Tensor, dtype: str) -> memoryview:
    """The little-endian bytes of ``t`` cast to ``dtype`` (on its device; a CPU tensor of ``dtype`` is viewed)."""
    import torch

    if sys.byteorder != "little":
        raise CheckpointError("safetensors data is little-endian; MergePipe needs a little-endian host")
    out = t.detach().to(dtype=torch_dtype(dtype)).to(device="cpu").contiguous()
    if out.numel() == 0:
        return memoryview(b"")
    return out.reshape(-1).view(torch.uint8).numpy().data


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
    """Where every tensor of a created safetensors file lives: in the file ``path``, or ``buffer`` (in memory)."""

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


def shard_header(entries: Entries, metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """What ``create_shard`` writes first (the length prefix and the padded header), and the file's size."""
    layout, header = _layout(Path(), entries, metadata)
    return header, layout.file_size


def create_shard(path: str | os.PathLike[str], entries: Entries, metadata: dict[str, str] | None = None) -> ShardLayout:
    """Create ``path`` exclusively with the header of ``entries``, preallocated: a disk too small fails here."""
    layout, header = _layout(Path(path), entries, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if layout.file_size > 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, layout.file_size)
            except OSError as exc:  # where the filesystem cannot, only extended; a full disk fails here
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
        os.ftruncate(fd, layout.file_size)
        _pwrite_all(fd, memoryview(header), 0)
    except BaseException:
        os.close(fd)
        Path(path).unlink(missing_ok=True)
        raise
    os.close(fd)
    return layout


def has_header(fd: int, header: bytes) -> bool:
    """Whether the file open as ``fd`` starts with ``header`` (``shard_header``'s bytes)."""
    return os.pread(fd, len(header), 0) == header


def memory_shard(name: str, entries: Entries, metadata: dict[str, str] | None = None) -> ShardLayout:
    """``create_shard`` into memory: filled, the buffer is the file ``create_shard`` would have written."""
    layout, header = _layout(Path(name), entries, metadata)
    buffer = bytearray(header)
    buffer.extend(bytes(layout.file_size - layout.data_start))
    return ShardLayout(layout.path, layout.data_start, layout.slots, buffer)


def tensors(layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Each tensor of a filled ``memory_shard``, viewing its buffer (no copy)."""
    import torch

    if layout.buffer is None:
        raise ValueError(f"{layout.path} is not held in memory")
    views = {}
    for name, slot in layout.slots.items():
        dtype, count = torch_dtype(slot.dtype), slot.nbytes // DTYPE_SIZES[slot.dtype]
        start = layout.data_start + slot.begin
        if count == 0:
            views[name] = torch.empty(slot.shape, dtype=dtype)
        else:
            views[name] = torch.frombuffer(layout.buffer, dtype=dtype, count=count, offset=start).view(slot.shape)
    return views


def _layout(path: Path, entries: Entries, metadata: dict[str, str] | None) -> tuple[ShardLayout, bytes]:
    """The layout of a file of ``entries`` and its first bytes: the length prefix and the padded header."""
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
        slots[name] = _Slot(dtype, shape, offset, offset + math.prod(shape) * DTYPE_SIZES[dtype])
        offset = slots[name].end
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
    header = len(raw).to_bytes(HEADER_PREFIX_BYTES, "little") + raw
    return ShardLayout(path, len(header), slots), header


class _Coverage:
    """Disjoint written byte ranges of one tensor, in order."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.covered = 0

    def reserve(self, start: int, end: int) -> bool:
        """Record ``[start, end)``; False (and nothing recorded) if it overlaps."""
        if start == end:
            return True
        i = bisect.bisect_left(self.ranges, (start, end))
        if (i > 0 and self.ranges[i - 1][1] > start) or (i < len(self.ranges) and self.ranges[i][0] < end):
            return False
        self.ranges.insert(i, (start, end))
        self.covered += end - start
        return True


class ShardWriter(AbstractContextManager["ShardWriter"]):
    """Positional writes into some tensors of a created shard, from any thread, each byte exactly once."""

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
        self._fd = None if layout.buffer is not None else os.open(layout.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bytes_written(self) -> int:
        with self._lock:
            return self._bytes_written

    def write(self, name: str, tensor_offset_bytes: int, data: Buffer) -> None:
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
        """Copy ``length`` bytes of ``source_fd`` into tensor ``name`` in the kernel, then read them back once."""
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

    def finish(self) -> None:
        """Close; ``ValueError`` if a write failed or a tensor is incomplete (durability is the publisher's)."""
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
        """Close the file (idempotent; no completeness check)."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _open_fd(self) -> int:
        if self._closed or self._fd is None:
            raise ValueError(f"{self.layout.path}: write after the writer was closed")
        return self._fd

    def _reserve(self, name: str, offset: int, length: int) -> int:
        """The file offset of bytes ``[offset, offset+length)`` of ``name``, recorded as written once."""
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
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a range of ``fd`` to disk without waiting (``SYNC_FILE_RANGE_WRITE``): the fsync finds less."""
    function = _sync_file_range()
    if function is not None and length > 0:
        function(fd, offset, length, 2)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


#: Bytes queued behind the producer: a run of copied blocks (pure I/O, queued at once) does not stop it from
#: reaching the next block to merge; copied blocks are read buffers held anyway.
DEFAULT_QUEUE_BYTES = 128 * 1024 * 1024


class WriteBehind(AbstractContextManager["WriteBehind"]):
    """``ShardWriter.write`` calls done on one background thread in the order queued, within ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_QUEUE_BYTES, name: str = "mergepipe-write") -> None:
        self.max_bytes = max(1, max_bytes)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._room = threading.Condition()
        self._queued = 0
        self._closed = False
        self._dropping = False  # after a failure, or abandoned: jobs only release their bytes
        self._error: BaseException | None = None
        #: seconds the writer thread spent writing (and hashing); seconds the producer waited for room
        self.write_seconds = 0.0
        self.wait_seconds = 0.0

    def __exit__(self, *exc: object) -> None:
        if exc[1] is None:
            self.close()
        else:
            self.abandon()

    def write(
        self, writer: ShardWriter, name: str, offset: int, data: Buffer, done: Callable[[], None] | None = None
    ) -> None:
        """Queue ``writer.write(name, offset, data)``, then ``done()``; ``data`` stays unchanged until ``done``."""
        view = memoryview(data).cast("B")
        self._queue(partial(writer.write, name, offset, view), len(view), done)

    def call(self, work: Callable[[], object]) -> None:
        """Queue ``work()`` after the writes queued before it."""
        self._queue(work, 0, None)

    def _queue(self, work: Callable[[], object], nbytes: int, done: Callable[[], None] | None) -> None:
        started = time.perf_counter()
        with self._room:
            while self._error is None and self._queued and self._queued + nbytes > self.max_bytes:
                self._room.wait()
            self.wait_seconds += time.perf_counter() - started
            if self._error is not None or self._closed:
                if done is not None:
                    done()
                self._raise()
                raise ValueError("write after the write-behind queue was closed")
            self._queued += nbytes
        self._pool.submit(self._do, work, nbytes, done)

    def _do(self, work: Callable[[], object], nbytes: int, done: Callable[[], None] | None) -> None:
        started = time.perf_counter()
        error = None if self._dropping else _attempt(work)
        released = _attempt(done) if done is not None else None  # whether the write failed or not
        with self._room:
            self.write_seconds += time.perf_counter() - started
            self._queued -= nbytes
            if self._error is None:
                self._error = error if error is not None else released
            self._dropping = self._dropping or self._error is not None
            self._room.notify_all()

    def close(self) -> None:
        """Wait until every queued write is done; raise the first failure. Idempotent."""
        started = time.perf_counter()
        with self._room:
            self._closed = True
        self._pool.shutdown(wait=True)
        self.wait_seconds += time.perf_counter() - started
        self._raise()

    def abandon(self) -> None:
        """Stop after the write in progress, dropping what is queued."""
        with self._room:
            self._closed = self._dropping = True
        self._pool.shutdown(wait=True)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def _attempt(function: Callable[[], object]) -> BaseException | None:
    """What ``function()`` raised, for the producer to raise (never swallowed)."""
    try:
        function()
    except BaseException as exc:
        return exc
    return None


#: How a file was placed: ``LINKED`` only in the manifests of earlier MergePipes, which hard-linked.
LINKED, CLONED, COPIED = "linked", "cloned", "copied"
#: ``FICLONE`` and ``copy_file_range`` errors that mean the filesystem (or this pair of files) cannot do it.
_UNSUPPORTED = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY}
#: ``ioctl(dest, FICLONE, src)`` (Linux ``_IOW(0x94, 9, int)``): the whole file, sharing its extents.
_FICLONE = 0x40049409
#: Bytes per step of the plain read-and-write copy, where the kernel cannot copy.
_COPY_STEP_BYTES = 8 * 1024 * 1024
#: Opening read-only without following a final symbolic link (nor blocking on a FIFO left in its place).
_READ_NO_LINK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def place_file(source_fd: int, target: str | os.PathLike[str]) -> str:
    """Create ``target`` with the bytes of ``source_fd``, a file of its own: ``CLONED`` (a reflink) or ``COPIED``."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        method = CLONED if _clone(source_fd, fd) else COPIED
        if method == COPIED:
            copy_range(source_fd, fd, 0, 0, os.fstat(source_fd).st_size)
    except BaseException:
        os.close(fd)
        Path(target).unlink(missing_ok=True)
        raise
    os.close(fd)
    return method


def open_inside(root: str | os.PathLike[str], name: str) -> int:
    """A read-only descriptor of the plain file ``name`` under ``root``, reached through no symbolic link."""
    *folders, leaf = PurePosixPath(name).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for folder in folders:
            inner = os.open(folder, _READ_NO_LINK | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        found = os.open(leaf, _READ_NO_LINK, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(found).st_mode):
        os.close(found)
        raise OSError(errno.EINVAL, f"{Path(root) / name} is not a plain file")
    return found


def _clone(source_fd: int, target_fd: int) -> bool:
    """Whether ``target_fd`` now shares ``source_fd``'s extents."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fcntl.ioctl(target_fd, _FICLONE, source_fd)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


def copy_range(source_fd: int, target_fd: int, source_offset: int, target_offset: int, length: int) -> None:
    """Copy ``length`` bytes between two files in the kernel where it can, else by positional reads and writes."""
    done = 0
    kernel = hasattr(os, "copy_file_range")
    while done < length:
        if kernel:
            try:
                n = os.copy_file_range(source_fd, target_fd, length - done, source_offset + done, target_offset + done)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                kernel = False  # this pair of files cannot: the rest by hand
                continue
        else:
            data = os.pread(source_fd, min(_COPY_STEP_BYTES, length - done), source_offset + done)
            _pwrite_all(target_fd, memoryview(data), target_offset + done)
            n = len(data)
        if n == 0:
            raise OSError(
                errno.EIO,
                f"the source ended at byte {source_offset + done}, before the {length} bytes to copy from byte "
                f"{source_offset}",
            )
        done += n


class OpenFiles(AbstractContextManager["OpenFiles"]):
    """Read-only descriptors of files copied from, each opened once (through no final link); closed together."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, path: str | os.PathLike[str]) -> int:
        if Path(path) not in self._fds:
            self._fds[Path(path)] = os.open(path, _READ_NO_LINK)
        return self._fds[Path(path)]

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

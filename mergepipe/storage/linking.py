"""A file into place without writing its bytes through this process: a reflink, else a copy by the kernel.

An incremental merge's output file that is byte for byte a file of the
previous snapshot is *placed* instead of made (``place_file``): a reflink
(Linux ``FICLONE``: btrfs, XFS and others share the extents, copy-on-write)
where the filesystem has them, else a copy made by the kernel
(``copy_file_range``: no byte passes through this process), else, where the
OS has no such call, a plain positional read and write. Either way the new
snapshot's file is an inode of its own: a hard link would share it, so an
edit to one snapshot's file would change the other's (the caller checks what
was placed: ``engine.place_reused``).

``copy_range`` is that last step for a part of a file: the reused runs of an
output file that is only partly the previous snapshot's. ``open_inside``
opens a snapshot's file without following a symbolic link out of it;
``OpenFiles`` keeps the sources of a unit's copies open once each.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
from pathlib import Path, PurePosixPath
from types import TracebackType

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
    """Create ``target`` (it must not exist) with the bytes of the file open read-only as ``source_fd``;
    how: ``CLONED`` or ``COPIED``. ``OSError`` for any other failure (a full disk, permissions), after
    removing what was created."""
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
    """A read-only descriptor of the plain file ``name`` (relative) under the directory ``root``, reached
    without following a symbolic link at any step below ``root``. ``OSError``: ``ELOOP`` or ``ENOTDIR``
    where a link is, ``ENOENT`` where nothing is, ``EINVAL`` for anything but a plain file."""
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
    """Whether ``target_fd`` now shares ``source_fd``'s extents (False where the filesystem cannot)."""
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
    """Copy ``length`` bytes at ``source_offset`` of ``source_fd`` to ``target_offset`` of ``target_fd``:
    in the kernel (``copy_file_range``) where it can, else by positional reads and writes. ``OSError``
    (``EIO``) when the source ends first."""
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
            n = _copy_step(
                source_fd, target_fd, source_offset + done, target_offset + done, min(_COPY_STEP_BYTES, length - done)
            )
        if n == 0:
            raise OSError(
                errno.EIO,
                f"the source ended at byte {source_offset + done}, before the "
                f"{length} bytes to copy from byte {source_offset}",
            )
        done += n


def _copy_step(source_fd: int, target_fd: int, source_offset: int, target_offset: int, length: int) -> int:
    data = os.pread(source_fd, length, source_offset)
    view, written = memoryview(data), 0
    while written < len(view):
        written += os.pwrite(target_fd, view[written:], target_offset + written)
    return len(data)


class OpenFiles:
    """Read-only descriptors of files copied from, each opened once; closed together."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def fd(self, path: str | os.PathLike[str]) -> int:
        key = Path(path)
        if key not in self._fds:
            self._fds[key] = os.open(key, _READ_NO_LINK)
        return self._fds[key]

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

"""Filesystem primitives for durable, atomic publishing.

Durability on POSIX needs two kinds of fsync: a file's own data and metadata
(``fsync_file``) and the directory entry that names it (``fsync_dir``). A
rename is atomic but only durable after its parent directory is fsynced.

Snapshots an earlier MergePipe published may share files (its incremental
merges hard-linked the files they took whole). So nothing here changes a file
it removes or publishes beyond clearing write bits:
removing a tree needs only its directories writable (an unlink never
touches the file's inode but for its link count), and a file already
read-only is left as it is.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "fsync_file",
    "fsync_dir",
    "fsync_tree",
    "make_read_only",
    "make_writable_tree",
    "remove_tree",
    "rename_no_replace",
    "exchange",
]

#: Write bits a published file loses: nobody may change a snapshot's bytes in place.
_ALL_WRITE = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
#: Write bits a published directory loses: only its owner may add or remove entries (so the owner can
#: delete the snapshot with ``rm -rf`` or ``mergepipe rm``, which needs a writable directory).
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def fsync_file(path: str | Path) -> None:
    """Flush a file's data and metadata (including its mode) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries, making creates/renames inside it durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file, then every directory bottom-up, ``root`` last."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                fsync_file(full)
        fsync_dir(dirpath)


def make_read_only(path: str | Path) -> None:
    """Publish modes: files lose every write bit (0o644 becomes 0o444); directories keep their owner's
    rwx and lose group and other write (0o755). A directory is done recursively, bottom-up.

    The bytes are immutable: nothing may rewrite a weight file in place. The directories stay the
    owner's to delete, as any folder is (``rm -rf``, ``mergepipe rm``); ``verify`` reports a file
    added, removed or edited all the same.
    """
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        if not path.is_symlink():
            _clear(path, _ALL_WRITE)
        return
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                _clear(full, _ALL_WRITE)
        os.chmod(dirpath, (stat.S_IMODE(os.stat(dirpath).st_mode) & ~_SHARED_WRITE) | stat.S_IRWXU)


def _clear(path: str | Path, bits: int) -> None:
    """Clear ``bits`` of a file's mode; a file without them (a linked one, published already) is not touched."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & bits:
        os.chmod(path, mode & ~bits)


def make_writable_tree(path: str | Path) -> None:
    """Give the owner write permission on ``path`` and everything under it (top-down)."""
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return
    os.chmod(path, stat.S_IMODE(path.stat().st_mode) | stat.S_IWUSR | stat.S_IXUSR * path.is_dir())
    if not path.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                continue
            mode = stat.S_IMODE(os.stat(full).st_mode) | stat.S_IWUSR
            os.chmod(full, mode | (stat.S_IXUSR if name in dirnames else 0))


def remove_tree(path: str | Path) -> None:
    """Remove a (possibly read-only) tree; a missing path is fine. Only its directories are made writable:
    its files are unlinked as they are, so a file another snapshot shares keeps its mode and bytes."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        _open_directories(path)
        shutil.rmtree(path)
    else:
        path.unlink()


def _open_directories(root: Path) -> None:
    """Give the owner rwx on ``root`` and every directory under it (top-down), so their entries can be
    removed; files are left alone."""
    def open_up(directory: str | Path) -> None:
        os.chmod(directory, stat.S_IMODE(os.stat(directory).st_mode) | stat.S_IRWXU)

    open_up(root)
    for dirpath, dirnames, _ in os.walk(root):  # each directory opened before os.walk lists it
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in dirnames:
            open_up(os.path.join(dirpath, name))


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return getattr(libc, "renameat2", None)


def rename_no_replace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` to ``dst``; raise ``FileExistsError`` if ``dst`` exists.

    Uses Linux ``renameat2(RENAME_NOREPLACE)`` so the check and the rename are
    one atomic step (a plain ``rename`` would silently replace an empty
    directory). Where that is unavailable (other OS, or a filesystem that does
    not support the flag) it falls back to check-then-rename.
    """
    src_b, dst_b = os.fsencode(src), os.fsencode(dst)
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, src_b, _AT_FDCWD, dst_b, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or err == errno.ENOTEMPTY:
            raise FileExistsError(err, os.strerror(err), os.fsdecode(dst_b))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), os.fsdecode(src_b), None, os.fsdecode(dst_b))
    if os.path.lexists(dst_b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(dst_b))
    os.rename(src_b, dst_b)


def exchange(src: str | Path, dst: str | Path) -> None:
    """Swap ``src`` and ``dst`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader of
    either path sees the old entry or the new one, never neither. OSError where that is unavailable."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "this system cannot swap two directories atomically (renameat2)", os.fspath(dst))
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))

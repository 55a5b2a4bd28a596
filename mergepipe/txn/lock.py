"""Liveness locks on staging directories.

A merge in progress holds an exclusive ``flock`` on its staging directory (the
lock follows the directory through the rename into place). ``recover`` runs
whenever a catalog is opened for writing, possibly while another process is
mid-merge, so it only touches a staging directory or a pending intent whose
lock it can take: a held lock means a live owner; a dead owner's lock is
released by the kernel, even after SIGKILL.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["DirLock"]


class DirLock:
    """An exclusive, non-blocking ``flock`` on a directory, released by ``release()``."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def try_acquire(cls, path: str | Path) -> DirLock | None:
        """The lock, or ``None`` if another open file description holds it.

        Raises ``FileNotFoundError`` if ``path`` does not exist.
        """
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, Path(path))

    def release(self) -> None:
        """Unlock and close; safe to call twice."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

"""Ask the kernel to read ahead what a merge is about to read, while the process still starts up.

An own-process merge spends its first second or so importing torch, with the
disk idle; a served one plans first. ``prefetch`` hands the byte ranges the
plan reads (``planner/reads.read_order``) to the kernel with
``posix_fadvise(WILLNEED)`` from a background thread, in the engine's
order, so the cold reads run during that time and the engine's own reads
then come from the page cache.

It is only a hint: nothing waits for it, a range that cannot be advised is
skipped, and where ``posix_fadvise`` does not exist (macOS, Windows) nothing
happens. It never reads more than ``limit_bytes`` (``default_limit``: a
quarter of the memory available now), so on a model larger than memory the
pages read ahead are not evicted again before the engine reaches them; the
engine's own read-ahead (``readahead.py``) does the rest.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

#: Bytes advised per call: the kernel submits each call's reads before it returns, so a large range is
#: cut to stop promptly at ``limit_bytes`` and to let the engine's reads interleave.
ADVICE_BYTES = 64 * 1024 * 1024

#: The share of the memory available at the start that read-ahead may fill.
MEMORY_SHARE = 0.25

_MEMINFO = Path("/proc/meminfo")


def default_limit() -> int:
    """A quarter of the memory available now (``MemAvailable``: free plus reclaimable page cache),
    0 where that cannot be known."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * MEMORY_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def prefetch(ranges: Sequence[tuple[Path, int, int]], limit_bytes: int) -> threading.Thread | None:
    """Start advising ``ranges`` in order, at most ``limit_bytes`` of them, on a daemon thread (returned,
    None when there is nothing to do)."""
    if not ranges or limit_bytes <= 0 or not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_advise, args=(list(ranges), limit_bytes), name="mergepipe-prefetch",
                              daemon=True)
    thread.start()
    return thread


def _advise(ranges: list[tuple[Path, int, int]], limit_bytes: int) -> None:
    fds: dict[Path, int | None] = {}
    left = limit_bytes
    try:
        for path, begin, end in ranges:
            if path not in fds:
                fds[path] = _open(path)
            fd = fds[path]
            while fd is not None and begin < end and left > 0:
                length = min(end - begin, ADVICE_BYTES, left)
                try:
                    os.posix_fadvise(fd, begin, length, os.POSIX_FADV_WILLNEED)
                except OSError:
                    break  # a hint: the engine's own read of this range reports any real error
                begin += length
                left -= length
            if left <= 0:
                return
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def _open(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None

"""What this process has used so far: CPU seconds, peak resident memory, bytes read and written.

For ``--json-summary``: the merge command reports its own figures, so that a script or benchmark has
them without measuring the process from outside.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

#: ``ru_maxrss`` is in KiB on Linux and in bytes on macOS.
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def process_usage() -> dict[str, float | int | None]:
    """``cpu_seconds`` (user + system), ``peak_rss_bytes``, and ``read_bytes`` / ``write_bytes`` at the
    storage layer (page-cache hits are not reads; ``None`` where ``/proc/self/io`` cannot be read)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    io = _proc_io()
    return {
        "cpu_seconds": own.ru_utime + own.ru_stime,
        "peak_rss_bytes": own.ru_maxrss * _MAXRSS_UNIT,
        "read_bytes": io.get("read_bytes"),
        "write_bytes": io.get("write_bytes"),
    }


def _proc_io() -> dict[str, int]:
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:  # not Linux, or a kernel without task I/O accounting
        return {}
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): int(value) for key, value in fields}

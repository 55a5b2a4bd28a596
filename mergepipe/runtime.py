"""What the process does while it works: the one progress bar (bytes, speed, time left; on stderr, only
on a terminal), the compute threads torch may use, and the resources used so far (``--json-summary``).
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from mergepipe.errors import visible

#: ``advance(nbytes, description)``: record progress; the description names the current item.
Advance = Callable[[int, str], None]

_WIDTH = 40


@contextmanager
def byte_progress(label: str, total: int, enabled: bool, status: Callable[[], str] | None = None) -> Iterator[Advance]:
    """A bar labelled ``label`` over ``total`` bytes; yields ``advance``. ``status()`` is shown after the time
    left, refreshed on every advance (a remote source's rate and request count)."""
    console = Console(stderr=True)
    bar = Progress(
        TextColumn(f"[bold]{label}[/] {{task.description:<{_WIDTH}}}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=not enabled or not console.is_terminal,
        transient=True,
    )
    with bar:
        task = bar.add_task("", total=total, status="")

        def advance(nbytes: int, description: str) -> None:
            # a tensor or file name is shown as it is (its control characters spelled), never read as markup
            bar.update(
                task,
                advance=nbytes,
                description=escape(visible(_short(description))),
                status=escape(status()) if status else "",
            )

        yield advance


@contextmanager
def count_progress(label: str, total: int, unit: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bar over ``total`` things (``unit``: what they are, e.g. "sequences"); yields ``advance(n)``."""
    console = Console(stderr=True)
    bar = Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled or not console.is_terminal,
        transient=True,
    )
    with bar:
        task = bar.add_task("", total=total)
        yield lambda n: bar.update(task, advance=n)


def _short(name: str) -> str:
    return name if len(name) <= _WIDTH else "…" + name[-(_WIDTH - 1) :]


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


def default_compute_threads() -> int:
    """All cores but one (at least one): the spare core runs reads and hashing."""
    return max(1, (os.cpu_count() or 1) - 1)


@contextmanager
def compute_threads(threads: int | None = None) -> Iterator[int]:
    """Run a block with ``threads`` intra-op torch threads (default above)."""
    import torch  # here: the progress bar and usage figures need no torch

    wanted = default_compute_threads() if threads is None else max(1, threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(previous)

"""What the process does while it works: the one progress bar (on stderr, only on a terminal), the compute
threads torch may use, and the resources used so far (``--json-summary``)."""

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
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from mergepipe.errors import visible

#: ``advance(nbytes, description)``: record progress; the description names the current item.
Advance = Callable[[int, str], None]

_WIDTH = 40


def _bar(enabled: bool, *columns: str | ProgressColumn) -> Progress:
    console = Console(stderr=True)
    return Progress(*columns, console=console, disable=not enabled or not console.is_terminal, transient=True)


@contextmanager
def byte_progress(label: str, total: int, enabled: bool, status: Callable[[], str] | None = None) -> Iterator[Advance]:
    """A bar over ``total`` bytes; yields ``advance``. ``status()`` is shown after the time left."""
    bar = _bar(
        enabled,
        TextColumn(f"[bold]{label}[/] {{task.description:<{_WIDTH}}}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with bar:
        task = bar.add_task("", total=total, status="")

        def advance(nbytes: int, description: str) -> None:
            short = description if len(description) <= _WIDTH else "…" + description[-(_WIDTH - 1) :]
            # a name is shown as it is (its control characters spelled), never read as markup
            status_text = escape(status()) if status else ""
            bar.update(task, advance=nbytes, description=escape(visible(short)), status=status_text)

        yield advance


@contextmanager
def count_progress(label: str, total: int, unit: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bar over ``total`` things (``unit``: what they are, e.g. "sequences"); yields ``advance(n)``."""
    bar = _bar(
        enabled,
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeRemainingColumn(),
    )
    with bar:
        task = bar.add_task("", total=total)
        yield lambda n: bar.update(task, advance=n)


def process_usage() -> dict[str, float | int | None]:
    """``cpu_seconds`` (user + system), ``peak_rss_bytes``, and ``read_bytes`` / ``write_bytes`` at the
    storage layer (``None`` where ``/proc/self/io`` cannot be read)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:  # not Linux, or a kernel without task I/O accounting
        lines = []
    io = {key.strip(): int(value) for key, value in (line.split(":", 1) for line in lines if ":" in line)}
    return {
        "cpu_seconds": own.ru_utime + own.ru_stime,
        "peak_rss_bytes": own.ru_maxrss * (1 if sys.platform == "darwin" else 1024),  # bytes on macOS, else KiB
        "read_bytes": io.get("read_bytes"),
        "write_bytes": io.get("write_bytes"),
    }


@contextmanager
def compute_threads(threads: int | None = None) -> Iterator[int]:
    """Run a block with ``threads`` intra-op torch threads (default: all cores but one, which reads and hashes)."""
    import torch  # here: the progress bar and usage figures need no torch

    wanted = max(1, (os.cpu_count() or 1) - 1) if threads is None else max(1, threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(previous)

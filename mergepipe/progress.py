"""The one progress bar: bytes done of a known total, with speed and time left.

Analysis and the engine both report progress as bytes; a bar is drawn on
stderr only when asked for and when stderr is a terminal, so logs and tests
stay clean.
"""

from __future__ import annotations

from contextlib import contextmanager
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
def byte_progress(label: str, total: int, enabled: bool,
                  status: Callable[[], str] | None = None) -> Iterator[Advance]:
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
            bar.update(task, advance=nbytes, description=escape(visible(_short(description))),
                       status=escape(status()) if status else "")

        yield advance


@contextmanager
def count_progress(label: str, total: int, unit: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bar over ``total`` things (``unit``: what they are, e.g. "sequences"); yields ``advance(n)``."""
    console = Console(stderr=True)
    bar = Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                   TimeRemainingColumn(), console=console, disable=not enabled or not console.is_terminal,
                   transient=True)
    with bar:
        task = bar.add_task("", total=total)
        yield lambda n: bar.update(task, advance=n)


def _short(name: str) -> str:
    return name if len(name) <= _WIDTH else "…" + name[-(_WIDTH - 1):]

"""Where `merge` and `execute` run their work units: threads of this process (the default) or Ray tasks.

The options are shared by both commands; ``open_executor`` turns them into an
``Executor`` for the engine, connecting to Ray (or starting a Ray instance of
the command's own) only when ``--executor ray`` is asked for, and
disconnecting when the merge is done. Ray itself is imported only then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from mergepipe.engine.executor import Executor, LocalExecutor
from mergepipe.engine.ray_executor import INSTALL_HINT, ray_executor
from mergepipe.errors import ConfigError

#: The ``--executor`` choices.
EXECUTORS = ("local", "ray")


def executor_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--executor``, ``--ray-address`` and ``--workers``."""
    options = [
        click.option("--executor", type=click.Choice(EXECUTORS), default="local", show_default=True,
                     help="Where work units run: threads of this process, or tasks on a Ray cluster "
                     f"(`{INSTALL_HINT}`; the checkpoints, the catalog's delta stores and --out must be on a "
                     "filesystem every worker sees, or the checkpoints in object storage). The output is the "
                     "same bytes and snapshot either way."),
        click.option("--ray-address", default=None, metavar="ADDRESS",
                     help="With --executor ray: auto (the cluster `ray start` joined this machine to), "
                     "ray://HOST:PORT (Ray client), HOST:PORT, or local (a Ray instance for this command only) "
                     "[default: $RAY_ADDRESS, else local]."),
        click.option("--workers", type=click.IntRange(min=1), default=None,
                     help="Work units run at once: threads (local), or Ray tasks of one core each "
                     "[default: 1 thread; with Ray, the cluster's cores]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@contextmanager
def open_executor(kwargs: dict[str, Any]) -> Iterator[Executor]:
    """The executor the options ask for, for the duration of one merge."""
    if kwargs["executor"] == "local":
        if kwargs["ray_address"] is not None:
            raise ConfigError("--ray-address needs --executor ray")
        yield LocalExecutor(kwargs["workers"] or 1)
        return
    with ray_executor(kwargs["ray_address"], kwargs["workers"]) as executor:
        yield executor

"""Where `merge` and `execute` run their work units: threads of this process (the default) or Ray tasks.

The options are shared by both commands; ``merge_run.open_executor`` turns
them into an ``Executor`` for the engine. This module loads neither the
engine nor torch (``merge_cmds.py`` says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from mergepipe.engine.defaults import RAY_INSTALL_HINT

#: The ``--executor`` choices.
EXECUTORS = ("local", "ray")


def executor_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--executor``, ``--ray-address`` and ``--workers``."""
    options = [
        click.option("--executor", type=click.Choice(EXECUTORS), default="local", show_default=True,
                     help="Where work units run: threads of this process, or tasks on a Ray cluster "
                     f"(`{RAY_INSTALL_HINT}`; the checkpoints, the catalog's delta stores and --out must be on a "
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

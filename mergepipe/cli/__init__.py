"""The `mergepipe` command line: thin click adapters around library calls.

Every expected failure is a ``MergePipeError``; ``main`` prints its one-line
message and exits non-zero without a traceback. Commands live in small
modules by theme and are attached to the one group here.
"""

from __future__ import annotations

import sys

import click

from mergepipe import __version__
from mergepipe.errors import MergePipeError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mergepipe")
def cli() -> None:
    """MergePipe: budget-aware parameter management for LLM merging."""


def _attach_commands() -> None:
    # Imported here so each module can import `cli` without a cycle.
    from mergepipe.cli import catalog_cmds

    for command in catalog_cmds.COMMANDS:
        cli.add_command(command)


_attach_commands()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI, turning MergePipeError into one line."""
    try:
        cli.main(args=argv, prog_name="mergepipe", standalone_mode=False)
    except MergePipeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)

"""Options and output helpers shared by the command modules."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import click
from rich.console import Console

from mergepipe.errors import MergePipeError
from mergepipe.spec.seconds import describe

DB_OPTION = click.option(
    "--db",
    "db_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Catalog file (SQLite), as created by `mergepipe init-db`.",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def plain_console(stderr: bool = False) -> Console:
    """The console every command prints tables and lines through: what it prints (paths, model ids, tensor
    names: strings people chose) is shown as it is, never read as rich markup (``[/x]`` would raise,
    ``[red]`` vanish) or emoji codes; styles are given as ``Text`` styles instead."""
    return Console(stderr=stderr, markup=False, emoji=False)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def predicted_text(seconds: Mapping[str, float] | None) -> str:
    """Predicted seconds on one line: the total, how uncertain, its terms and what they were learnt from."""
    return describe(seconds)


def run_command_line(group: click.Group, argv: list[str] | None) -> None:
    """Run ``group`` on ``argv`` (the process's arguments when None); an expected failure
    (``MergePipeError``, Ctrl-C, a usage error) prints one line and exits non-zero without a traceback."""
    try:
        group.main(args=argv, prog_name="mergepipe", standalone_mode=False)
    except MergePipeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)

"""Options and output helpers shared by the command modules."""

from __future__ import annotations

import json
from pathlib import Path

import click

DB_OPTION = click.option(
    "--db",
    "db_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Catalog file (SQLite), as created by `mergepipe init-db`.",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))

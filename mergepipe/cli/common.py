"""Options and output helpers shared by the command modules."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mergepipe.spec.seconds import UNCALIBRATED, ordered_phases

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


def predicted_text(seconds: dict[str, float] | None) -> str:
    """Predicted seconds per phase and the total, on one line; or why there are none."""
    if not seconds:
        return UNCALIBRATED
    return " · ".join(f"{label} {value:.1f} s" for label, value in ordered_phases(seconds))

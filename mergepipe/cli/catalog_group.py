"""`mergepipe catalog ...`: operations on a catalog as a whole; `export` copies one across backends
(``app/exporting.py``)."""

from __future__ import annotations

import click

from mergepipe.app.exporting import export_catalog
from mergepipe.catalog.location import Location
from mergepipe.cli.common import CATALOG, DB_OPTION, ConsoleReporter, echo


@click.group("catalog")
def catalog_group() -> None:
    """Operations on a whole catalog: export copies it to another file or PostgreSQL database."""


@catalog_group.command("export")
@DB_OPTION
@click.option("--to", "target", required=True, type=CATALOG,
              help="The catalog to copy into: a new file, or an empty PostgreSQL database "
              "(postgresql://USER@HOST:PORT/DBNAME) that gets the schema.")
def export_cmd(db_path: Location, target: Location) -> None:
    """Copy every record of a catalog (models, analyses, plans, snapshots, timings, evaluations) and its search
    studies into a new one, SQLite or PostgreSQL, so that nothing is registered or analysed again."""
    done = export_catalog(db_path, target, reporter=ConsoleReporter())
    tables = sum(1 for n in done.rows.values() if n)
    echo(f"exported {done.source} to {done.target}: {done.total} rows in {tables} tables "
         f"({done.rows['models']} models, {done.rows['plans']} plans, {done.rows['snapshots']} snapshots)"
         + (f" and {len(done.studies)} search studies" if done.studies else ""))


COMMANDS = [catalog_group]

"""`mergepipe diff A B`: what differs between two snapshots (inputs, then tensors by size of change)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from mergepipe.catalog import Catalog
from mergepipe.cli.common import DB_OPTION, JSON_OPTION, plain_console
from mergepipe.planner.diff import diff_snapshots
from mergepipe.planner.html.diff_page import render_diff
from mergepipe.txn.outpath import writable_file, write_report


@click.command("diff")
@DB_OPTION
@click.argument("a")
@click.argument("b")
@click.option("--top", default=20, show_default=True, type=click.IntRange(min=1),
              help="How many tensors to list (and chart, with --html), largest relative change first (all with "
                   "--json).")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the difference to this file as one self-contained HTML page (input differences, a bar "
                   "chart of the relative change per tensor; no network) instead of printing it. An existing file "
                   "is refused unless --force.")
@click.option("--force", is_flag=True, help="Overwrite an existing --html file (never one inside a registered "
              "model or snapshot).")
@JSON_OPTION
def diff_cmd(db_path: Path, a: str, b: str, top: int, html_path: Path | None, force: bool, as_json: bool) -> None:
    """What differs from snapshot A to snapshot B: inputs, and the tensors that changed most.

    A and B are snapshot ids (or unique prefixes) or merged model ids (name@N for a version).
    """
    with Catalog.open(db_path) as catalog:
        if html_path is not None:
            html_path = writable_file(catalog, html_path, force, "--html")
        result = diff_snapshots(catalog, a, b)
    if html_path is not None:
        write_report(html_path, render_diff(result, top))
        click.echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    if html_path is not None:
        return
    console = plain_console()
    console.print(Text.assemble((result.a, "bold"), " -> ", (result.b, "bold")))
    for line in result.inputs or ["inputs: the same experts, versions, parameters and budget"]:
        console.print(f"  {line}")
    table = Table(title=f"tensors by relative change ‖B − A‖ / ‖A‖ (top {top})")
    for column in ("tensor", "relative change", "experts whose planned blocks differ"):
        table.add_column(column, overflow="fold")
    for t in result.tensors[:top]:
        table.add_row(t.tensor, f"{t.relative_change:.3e}", ", ".join(t.experts) or "-")
    console.print(table)


COMMANDS = [diff_cmd]

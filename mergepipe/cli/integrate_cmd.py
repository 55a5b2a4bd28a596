"""`mergepipe integrate RECIPE.yml`: one iteration of continuous integration (``app/integration.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from mergepipe.app.integration import Integration, integrate
from mergepipe.app.merging import Execution
from mergepipe.cli.common import DB_OPTION, NO_PROGRESS_OPTION, ConsoleReporter, echo, plain_console, predicted_text
from mergepipe.cli.options import execution_options
from mergepipe.sizes import format_bytes


@click.command("integrate")
@DB_OPTION
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False, path_type=Path))
@execution_options
@NO_PROGRESS_OPTION
def integrate_cmd(db_path: Path, recipe_path: Path, no_progress: bool, **kwargs: Any) -> None:
    """Run one iteration of the pipeline RECIPE describes (a YAML file: base, experts, merge, output).

    Registers changed expert directories as new versions (a Hub, S3 or HTTP expert is re-checked by its
    commit or ETags, its headers read only when they changed), analyses incrementally, merges incrementally
    from the latest published version and publishes the next one; publishes nothing when nothing changed.
    The merge runs as `merge` runs it (--device, --max-memory, --executor, --workers).
    """
    execution = Execution(**kwargs, progress=not no_progress)
    _print(integrate(recipe_path, db_path, execution=execution, reporter=ConsoleReporter()))


def _print(done: Integration) -> None:
    console = plain_console()
    recipe = done.recipe
    table = Table(title=f"integrate {recipe.path.name}: inputs", show_header=True)
    for column in ("model", "version", "status", "directory"):
        table.add_column(column)
    for r in done.registrations:
        table.add_row(r.record.name, r.record.label, r.status, r.record.uri)
    console.print(table)
    if done.analysis is not None:
        for expert, (unchanged, total) in done.analysis.inherited.items():
            console.print(f"  {expert}: analysed {total - unchanged} of {total} tensors ({unchanged} unchanged)")
        fresh = [e for e in done.analysis.analyzed if e not in done.analysis.inherited]
        if fresh:
            console.print(f"  analysed {', '.join(fresh)} in full")
    for path in done.removed:
        console.print(f"  removed {path} (older than the last {recipe.keep} versions)")
    for warning in done.warnings:
        echo(f"warning: {warning}", err=True)
    if done.current is not None:
        console.print(f"nothing changed since {done.current}: nothing published")
        return
    assert done.published is not None
    snapshot_id, out, manifest = done.published
    realized, plan = manifest.cost.realized, done.plan
    if done.scratch is not None:
        console.print(f"merged from scratch (the same bytes as incrementally): {done.scratch}")
    console.print(f"published {manifest.model_id} ({snapshot_id}) at {out}; verified")
    console.print(f"  expert bytes read {format_bytes(realized.expert_bytes)} of "
                  f"{format_bytes(plan.cost.expert_bytes)} planned; base {format_bytes(realized.base_bytes)}; "
                  f"{realized.seconds.get('total', 0.0):.1f} s")
    if manifest.cost.estimated.seconds:
        console.print(f"  predicted {predicted_text(manifest.cost.estimated.seconds)}")
    if plan.reuse is not None:
        console.print(f"  reused {plan.reuse.block_count} output blocks ({format_bytes(plan.reuse.output_bytes)}) "
                      f"of {plan.reuse.snapshot}: {format_bytes(plan.reuse.saved_bytes)} of expert reads saved")


COMMANDS = [integrate_cmd]

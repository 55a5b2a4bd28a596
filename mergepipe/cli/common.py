"""What the command modules share: the catalog option, the console, rendering a plan, and the one place
expected failures become one line."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from mergepipe.app.session import Reporter
from mergepipe.errors import MergePipeError
from mergepipe.sizes import format_bytes
from mergepipe.spec.prediction import describe

if TYPE_CHECKING:
    from mergepipe.spec.plan import Plan
    from mergepipe.txn.recover import RecoverReport

DB_OPTION = click.option(
    "--db",
    "db_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Catalog file (SQLite; created by the first command that writes to it, or by `mergepipe init-db`).",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
NO_PROGRESS_OPTION = click.option("--no-progress", is_flag=True, help="Do not show progress bars.")


def plain_console(stderr: bool = False) -> Console:
    """The console every command prints tables and lines through: what it prints (paths, model ids, tensor
    names: strings people chose) is shown as it is, never read as rich markup (``[/x]`` would raise,
    ``[red]`` vanish) or emoji codes; styles are given as ``Text`` styles instead."""
    return Console(stderr=stderr, markup=False, emoji=False)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


class ConsoleReporter(Reporter):
    """What an application call says while it runs, on stderr (stdout keeps the command's result);
    ``show_plan``: the plan a merge is about to execute, as a table."""

    def __init__(self, show_plan: bool = True) -> None:
        self.show_plan = show_plan

    def note(self, text: str) -> None:
        click.echo(text, err=True)

    def warning(self, text: str) -> None:
        click.echo(text, err=True)

    def planned(self, plan: Plan) -> None:
        if self.show_plan:
            plain_console(stderr=True).print(plan_summary(plan))

    def recovered(self, report: RecoverReport) -> None:
        dirs = f"director{'y' if len(report.removed) == 1 else 'ies'}"
        click.echo(f"recovered: committed {len(report.committed)}, aborted {len(report.aborted)}, "
                   f"removed {len(report.removed)} staging {dirs}", err=True)


def predicted_text(seconds: Mapping[str, float] | None) -> str:
    """Predicted seconds on one line: the total, how uncertain, its terms and what they were learnt from."""
    return describe(seconds)


def plan_summary(plan: Plan) -> Table:
    """The table `plan` and `merge` print."""
    cost = plan.cost
    table = Table(title=f"plan {plan.digest[:12]} — {plan.operator}, policy {plan.policy}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("budget", f"{plan.budget_text} = {format_bytes(plan.budget_bytes)}")
    table.add_row("expert bytes planned", f"{format_bytes(cost.expert_bytes)} of {format_bytes(cost.full_expert_bytes)}"
                  " changed (blocks identical to the base cost nothing)")
    reduction = cost.reduction
    table.add_row("expert I/O reduction", "no expert reads" if reduction is None else f"{reduction:.2f}x")
    table.add_row("base bytes / output bytes", f"{format_bytes(cost.base_bytes)} / {format_bytes(cost.output_bytes)}")
    table.add_row("error bound", f"{plan.error_bound:.6g} ({plan.error_bound_kind}); "
                  f"{100 * plan.error_share:.1f}% of the weighted task vectors (norm) left out")
    for expert, n in cost.expert_bytes_by_model.items():
        table.add_row(f"  {expert}", format_bytes(n))
    if plan.reuse is not None:
        table.add_row("reused", f"{plan.reuse.block_count} blocks ({format_bytes(plan.reuse.output_bytes)}) of "
                      f"'{plan.reuse.snapshot}'; expert bytes to read: "
                      f"{format_bytes(cost.expert_bytes - plan.reuse.saved_bytes)}")
    table.add_row("predicted seconds", predicted_text(plan.seconds.flat() if plan.seconds else None))
    for note in plan.notes:
        table.add_row("note", note)
    return table


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

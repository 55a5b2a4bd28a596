"""What the command modules share: the catalog option (``--db``, else the default catalog, named on
stderr), the console, rendering a plan, and the one place expected failures become one line."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.cells import cell_len
from rich.console import AlignMethod, Console, ConsoleOptions, RenderableType
from rich.rule import Rule
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text, TextType

from mergepipe.app.session import Reporter, default_catalog
from mergepipe.catalog.location import Location, ServerURL, catalog_location
from mergepipe.errors import MergePipeError, visible
from mergepipe.sizes import format_bytes
from mergepipe.spec.prediction import describe

if TYPE_CHECKING:
    from mergepipe.spec.plan import Plan
    from mergepipe.txn.recover import RecoverReport

def default_db() -> Location:
    """The default catalog (``$MERGEPIPE_DB``, else the per-user one), named on stderr. Its folder is
    created only by a command that writes to it (``app/session.py``), so a refused command leaves nothing."""
    found = default_catalog()
    echo(found.line(), err=True)
    return found.path


class CatalogParam(click.ParamType):
    """A catalog as ``--db`` takes it: a SQLite file's path (not a directory), or a PostgreSQL URL
    (``postgresql://USER@HOST:PORT/DBNAME``), kept as a ``ServerURL`` whose text hides any password."""

    name = "path|url"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Location:
        if isinstance(value, (Path, ServerURL)):
            return value
        found = catalog_location(str(value))  # another scheme: a CatalogError, one line like every refusal
        if isinstance(found, Path) and found.is_dir():
            self.fail(f"{found} is a directory; give a catalog file or a postgresql:// URL", param, ctx)
        return found


#: The ``--db`` value type of every command.
CATALOG = CatalogParam()


def _catalog_path(ctx: click.Context, param: click.Parameter, value: Location | None) -> Location:
    """``--db``, else the default catalog."""
    return value if value is not None else default_db()


DB_OPTION = click.option(
    "--db",
    "db_path",
    default=None,
    callback=_catalog_path,
    type=CATALOG,
    help="Catalog: a file (SQLite; created by the first command that writes to it, or by `mergepipe init-db`) or a "
    "PostgreSQL database several machines share (postgresql://USER@HOST:PORT/DBNAME; `init-db` creates the "
    "schema) [default: $MERGEPIPE_DB, else catalog.db in mergepipe/ of your data directory: on Linux "
    "$XDG_DATA_HOME (~/.local/share), on macOS ~/Library/Application Support, on Windows %LOCALAPPDATA%].",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
NO_PROGRESS_OPTION = click.option("--no-progress", is_flag=True, help="Do not show progress bars.")
QUIET_OPTION = click.option("--quiet", is_flag=True, help="No progress bars and no tables (the plan's, with its "
                            "notes, and the cost summary): other notes, warnings, errors and the one-line result only.")


#: The width of a console whose output is not a terminal (a pipe, a file, a CI log): no line is wrapped or
#: cut there, since nothing knows that reader's width; a table is as wide as its cells, not this.
PIPE_WIDTH = 100_000
#: The width of a rule (a section line) when not printing to a terminal; a longer title widens it.
PIPE_RULE_WIDTH = 80
#: The widest a summary table (`plan`, `merge`) is drawn, on a terminal or not: long cells wrap inside it.
TABLE_WIDTH = 100
#: The widest its label column is, so that a value of 64 characters (a hash) fits whole beside it.
LABEL_WIDTH = 28


class _Console(Console):
    """A console that prints every name as ``errors.visible`` spells it: no control character in a path or a
    tensor name reaches the terminal as one. Strings are spelled before they are measured, ``Text`` as drawn."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(visible(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            yield segment if segment.control else Segment(visible(segment.text), segment.style)


class _PipeConsole(_Console):
    """A console printing to a pipe or a file: very wide and without wrapping, so ids, paths and words
    stay whole (and greppable); a rule keeps a readable width instead of spanning that width."""

    def rule(self, title: TextType = "", *, characters: str = "─", style: str | Style = "rule.line",
             align: AlignMethod = "center") -> None:
        width = max(PIPE_RULE_WIDTH, cell_len(str(title)) + 6)
        self.print(Rule(title, characters=characters, style=style, align=align), width=width)


def plain_console(stderr: bool = False) -> Console:
    """The console every command prints tables and lines through: what it prints (paths, model ids, tensor
    names: strings people chose) is shown as it is, never read as rich markup (``[/x]`` would raise,
    ``[red]`` vanish) or emoji codes; styles are given as ``Text`` styles instead. On a terminal it wraps
    to the terminal's width; anywhere else nothing is wrapped, folded or cut (``_PipeConsole``)."""
    console = _Console(stderr=stderr, markup=False, emoji=False)
    if console.is_terminal:
        return console
    return _PipeConsole(stderr=stderr, markup=False, emoji=False, width=PIPE_WIDTH, soft_wrap=True)


def echo(text: str, err: bool = False) -> None:
    """Print a line of text as every command does: its names spelled by ``errors.visible``."""
    click.echo(visible(text), err=err)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def summary_table(title: str | None = None) -> Table:
    """An empty two-column (label, value) summary table, for ``print_summary``."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold", max_width=LABEL_WIDTH, overflow="fold")
    table.add_column(overflow="fold")
    return table


def print_summary(table: Table, notes: Sequence[str] = (), stderr: bool = False) -> None:
    """``table`` at most ``TABLE_WIDTH`` wide, or the terminal's width; then its notes under it, as lines."""
    console = plain_console(stderr)
    console.print(table, width=min(console.width, TABLE_WIDTH), soft_wrap=False)
    for note in notes:
        console.print(f"note: {note}")


class ConsoleReporter(Reporter):
    """What an application call says while it runs, on stderr (stdout keeps the command's result); the plan a
    merge is about to execute (a table, then its notes) unless ``quiet``."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def note(self, text: str) -> None:
        echo(text, err=True)

    def warning(self, text: str) -> None:
        echo(text, err=True)

    def planned(self, plan: Plan) -> None:
        if not self.quiet:
            print_summary(plan_summary(plan), plan.notes, stderr=True)

    def recovered(self, report: RecoverReport) -> None:
        dirs = f"director{'y' if len(report.removed) == 1 else 'ies'}"
        echo(f"recovered: committed {len(report.committed)}, aborted {len(report.aborted)}, "
             f"removed {len(report.removed)} staging {dirs}", err=True)


def predicted_text(seconds: Mapping[str, float] | None) -> str:
    """Predicted seconds on one line: the total, how uncertain, its terms and what they were learnt from."""
    return describe(seconds)


def plan_summary(plan: Plan) -> Table:
    """A plan's summary table (its notes go under it)."""
    cost = plan.cost
    table = summary_table(f"plan {plan.digest[:12]} — {plan.operator}, policy {plan.policy}")
    table.add_row("budget", f"{plan.budget_text} = {format_bytes(plan.budget_bytes)}")
    if plan.copies is not None:  # a passthrough: every byte its map names, from every source, and nothing else
        table.add_row("bytes copied", f"{format_bytes(cost.base_bytes + cost.expert_bytes)}: "
                      f"{len(plan.copies.copies)} tensors, {plan.copies.layers} layers, from every source")
    else:
        table.add_row("expert bytes planned", f"{format_bytes(cost.expert_bytes)} of "
                      f"{format_bytes(cost.full_expert_bytes)} changed (blocks identical to the base cost nothing)")
        reduction = cost.reduction
        table.add_row("expert I/O reduction", "no expert reads" if reduction is None else f"{reduction:.2f}x")
    table.add_row("base bytes / output bytes", f"{format_bytes(cost.base_bytes)} / {format_bytes(cost.output_bytes)}")
    table.add_row("error bound", f"{plan.error_bound:.6g} ({plan.error_bound_kind}, on the fp32 result before "
                  f"rounding to the output dtype); {100 * plan.error_share:.1f}% of the weighted task vectors (norm) "
                  "left out")
    if plan.estimate is not None:
        table.add_row("deviation estimate", f"{plan.estimate:.6g} (first order: the weighted norm of what the plan "
                      "leaves out; ranks plans as their measured deviation does)")
    for expert, n in cost.expert_bytes_by_model.items():
        table.add_row(f"  {expert}", format_bytes(n))
    if plan.reuse is not None:
        table.add_row("reused", f"{plan.reuse.block_count} blocks ({format_bytes(plan.reuse.output_bytes)}) of "
                      f"'{plan.reuse.snapshot}'; expert bytes to read: "
                      f"{format_bytes(cost.expert_bytes - plan.reuse.saved_bytes)}")
    table.add_row("predicted seconds", predicted_text(plan.seconds.flat() if plan.seconds else None))
    return table


def run_command_line(group: click.Command, argv: list[str] | None, prog_name: str = "mergepipe") -> None:
    """Run ``group`` (or one command: `mergepipe-yaml`) on ``argv`` (the process's arguments when None); an
    expected failure (``MergePipeError``, Ctrl-C, a usage error) prints one line and exits non-zero without
    a traceback."""
    try:
        group.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except MergePipeError as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)

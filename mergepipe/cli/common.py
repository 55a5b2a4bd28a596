"""What the command modules share: the options (``--db``, else the default catalog, named on stderr; a
merge's), the console and its tables, rendering a plan, and the one place expected failures become one line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
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

from mergepipe.app.planning import read_config
from mergepipe.app.session import Reporter, default_catalog
from mergepipe.catalog.database import Location, ServerURL, catalog_location
from mergepipe.engine import DEFAULT_MAX_MEMORY, RAY_INSTALL_HINT
from mergepipe.errors import ConfigError, MergePipeError, visible
from mergepipe.sizes import format_bytes
from mergepipe.spec.mergekit import merge_request
from mergepipe.spec.operators import ALIASES, FLAGS, OPERATORS, ParamDef
from mergepipe.spec.plan import describe
from mergepipe.spec.request import POLICIES, MergeRequest, parse_shard_bytes

if TYPE_CHECKING:
    from mergepipe.spec.plan import Plan
    from mergepipe.txn.recover import RecoverReport


def default_db(ctx: click.Context | None = None, param: object = None, value: Location | None = None) -> Location:
    """``--db``, else the default catalog (``$MERGEPIPE_DB``, else the per-user one), named on stderr; its
    folder is created only by a command that writes to it, so a refused command leaves nothing."""
    if value is not None:
        return value
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


CATALOG = CatalogParam()
DB_OPTION = click.option(
    "--db",
    "db_path",
    default=None,
    callback=default_db,
    type=CATALOG,
    help="Catalog: a file (SQLite; created by the first command that writes to it, or by `mergepipe init-db`) or a "
    "PostgreSQL database several machines share (postgresql://USER@HOST:PORT/DBNAME; `init-db` creates the "
    "schema) [default: $MERGEPIPE_DB, else catalog.db in mergepipe/ of your data directory: on Linux "
    "$XDG_DATA_HOME (~/.local/share), on macOS ~/Library/Application Support, on Windows %LOCALAPPDATA%].",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
FORCE_HTML_OPTION = click.option(
    "--force",
    is_flag=True,
    help="Overwrite an existing --html file (never the catalog, nor one inside a registered model or snapshot).",
)
NO_PROGRESS_OPTION = click.option("--no-progress", is_flag=True, help="Do not show progress bars.")
QUIET_OPTION = click.option(
    "--quiet",
    is_flag=True,
    help="No progress bars and no tables (the plan's, with its "
    "notes, and the cost summary): other notes, warnings, errors and the one-line result only.",
)


#: Off a terminal (a pipe, a file, a CI log) nothing is wrapped or cut: a table is as wide as its cells.
PIPE_WIDTH = 100_000
#: The widest a summary table (`plan`, `merge`) is drawn, and its label column (a 64-character hash fits).
TABLE_WIDTH, LABEL_WIDTH = 100, 28


class _Console(Console):
    """A console that prints every name as ``errors.visible`` spells it (strings before they are measured,
    ``Text`` as drawn): no control character in a path or a tensor name reaches the terminal as one."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(visible(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            yield segment if segment.control else Segment(visible(segment.text), segment.style)


class _PipeConsole(_Console):
    """A console printing to a pipe or a file: very wide and without wrapping, so ids, paths and words
    stay whole (and greppable); a rule keeps a readable width (80, or its title's)."""

    def rule(
        self,
        title: TextType = "",
        *,
        characters: str = "─",
        style: str | Style = "rule.line",
        align: AlignMethod = "center",
    ) -> None:
        width = max(80, cell_len(str(title)) + 6)
        self.print(Rule(title, characters=characters, style=style, align=align), width=width)


def plain_console(stderr: bool = False) -> Console:
    """The console every command prints through: strings people chose are shown as they are, never read as
    rich markup (``[/x]`` would raise, ``[red]`` vanish) or emoji codes (styles are ``Text`` styles); on a
    terminal it wraps to its width, anywhere else nothing is wrapped, folded or cut (``_PipeConsole``)."""
    console = _Console(stderr=stderr, markup=False, emoji=False)
    if console.is_terminal:
        return console
    return _PipeConsole(stderr=stderr, markup=False, emoji=False, width=PIPE_WIDTH, soft_wrap=True)


def echo(text: str, err: bool = False) -> None:
    """Print a line of text as every command does: its names spelled by ``errors.visible``."""
    click.echo(visible(text), err=err)


def echo_json(data: object, sort_keys: bool = True) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=sort_keys, default=str))


def table(
    title: str | None, columns: Iterable[str], rows: Iterable[Iterable[str]], right: Collection[str] = ()
) -> Table:
    """A table with a header: long cells wrap (never lose their end); the columns named in ``right`` are
    right-aligned."""
    made = Table(title=title)
    for column in columns:
        made.add_column(column, overflow="fold", justify="right" if column in right else "left")
    for row in rows:
        made.add_row(*row)
    return made


def summary_table(title: str | None, rows: Iterable[tuple[str, str]], label_width: int | None = LABEL_WIDTH) -> Table:
    """A two-column (label, value) summary table without a header, for ``print_summary``."""
    made = Table(title=title, show_header=False)
    made.add_column(style="bold", max_width=label_width, overflow="fold")
    made.add_column(overflow="fold")
    for row in rows:
        made.add_row(*row)
    return made


def print_summary(rows: Table, notes: Sequence[str] = (), stderr: bool = False) -> None:
    """``rows`` at most ``TABLE_WIDTH`` wide, or the terminal's width; then its notes under it, as lines."""
    console = plain_console(stderr)
    console.print(rows, width=min(console.width, TABLE_WIDTH), soft_wrap=False)
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
        echo(f"recovered: {report.summary()}", err=True)


def plan_summary(plan: Plan) -> Table:
    """A plan's summary table (its notes go under it)."""
    cost, reuse = plan.cost, plan.reuse
    rows = [("budget", f"{plan.budget_text} = {format_bytes(plan.budget_bytes)}")]
    if plan.copies is not None:  # a passthrough: every byte its map names, from every source, and nothing else
        copied = format_bytes(cost.base_bytes + cost.expert_bytes)
        rows.append(
            (
                "bytes copied",
                f"{copied}: {len(plan.copies.copies)} tensors, {plan.copies.layers} layers, from every source",
            )
        )
    else:
        rows += [
            (
                "expert bytes planned",
                f"{format_bytes(cost.expert_bytes)} of {format_bytes(cost.full_expert_bytes)} changed "
                "(blocks identical to the base cost nothing)",
            ),
            ("expert I/O reduction", "no expert reads" if cost.reduction is None else f"{cost.reduction:.2f}x"),
        ]
    rows.append(("base bytes / output bytes", f"{format_bytes(cost.base_bytes)} / {format_bytes(cost.output_bytes)}"))
    rows.append(
        (
            "error bound",
            f"{plan.error_bound:.6g} ({plan.error_bound_kind}, on the fp32 result before rounding to the output "
            f"dtype); {100 * plan.error_share:.1f}% of the weighted task vectors (norm) left out",
        )
    )
    if plan.estimate is not None:
        rows.append(
            (
                "deviation estimate",
                f"{plan.estimate:.6g} (first order: the weighted norm of what the plan leaves out; ranks plans "
                "as their measured deviation does)",
            )
        )
    rows += [(f"  {expert}", format_bytes(n)) for expert, n in cost.expert_bytes_by_model.items()]
    if reuse is not None:
        rows.append(
            (
                "reused",
                f"{reuse.block_count} blocks ({format_bytes(reuse.output_bytes)}) of '{reuse.snapshot}'; expert "
                f"bytes to read: {format_bytes(cost.expert_bytes - reuse.saved_bytes)}",
            )
        )
    rows.append(("predicted seconds", describe(plan.seconds.flat() if plan.seconds else None)))
    return summary_table(f"plan {plan.digest[:12]} — {plan.operator}, policy {plan.policy}", rows)


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


#: Flags that set the request field of their name.
FIELD_FLAGS = "base experts operator weights seed budget policy out_dtype previous delta_update model_id".split()


def _apply(func: Callable[..., Any], options: list[Callable[..., Any]]) -> Callable[..., Any]:
    for option in reversed(options):
        func = option(func)
    return func


def _param_option(d: ParamDef) -> Callable[..., Any]:
    """``--NAME`` for a parameter that has a flag (``ParamDef.flag``): its value for every expert."""
    if d.kind == "bool":
        return click.option(f"--{d.name}/--no-{d.name}", d.attribute, default=None, help=d.help())
    kind = click.Choice(list(d.choices)) if d.choices else int if d.kind == "int" else float
    return click.option(f"--{d.name}", d.attribute, type=kind, help=d.help())


class OperatorsHelp(click.Command):
    """A command whose help ends with the table of operators, from their registry."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name, op in OPERATORS.items():
            scopes = [("per expert", op.expert_params.names()), ("global", op.global_params.names())]
            takes = "; ".join(f"{scope}: {', '.join(names)}" for scope, names in scopes if names)
            rows.append((name, f"{op.summary} ({takes or 'no parameters'})."))
        with formatter.section("Operators (--operator; each but avg is mergekit's merge_method of that name)"):
            formatter.write_dl(rows)


def merge_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """What to merge and how (`plan`, `merge`): the models, the operator and its parameters, the budget, the
    output, and whether experts not analysed yet are analysed first."""
    return _apply(
        func,
        [
            click.option("--base", "base", help="Base model: a registered id or a checkpoint directory."),
            click.option(
                "--experts", "experts", multiple=True, help="Expert models (ids or directories): --experts A B C."
            ),
            click.option(
                "--operator",
                default=None,
                help=f"Merge operator: {', '.join(OPERATORS)} ({', '.join(f'{a} = {n}' for a, n in ALIASES.items())}) "
                "[default: ties].",
            ),
            click.option("--weights", multiple=True, type=float, help="One weight per expert: --weights 0.5 0.3."),
            *(_param_option(d) for d in FLAGS),
            click.option(
                "--config",
                "config_path",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="A mergekit config as it is (merge_method, base_model, models, parameters, ..., and a "
                "`mergepipe:` section with budget, policy, seed, block_bytes, model_id, out_shard_size), "
                "instead of --base/--experts/--operator; or MergePipe's `params:` (global) and "
                "`expert_params: {ID: {...}}`. Values may be gradients (lists) or "
                "[{filter: SUBSTRING, value: X}] rules. Flags override the config.",
            ),
            click.option("--seed", default=None, type=int, help="Seed of random operators [default: 0]."),
            click.option(
                "--budget",
                default=None,
                help="Expert-I/O budget: bytes, a size (906MB, 8GiB), a fraction (25%) or none; or a time "
                "(20s, 2min: converted into bytes through what this catalog's merges and analyses took on "
                "this machine), alone or with a byte budget (20s,8GiB: the tighter wins) [default: 100%].",
            ),
            click.option(
                "--policy",
                type=click.Choice(POLICIES),
                default=None,
                help="How to spend the budget: energy (blocks by weighted delta norm per byte), uniform "
                "(the same share of every tensor), full, or entries (sketches and exact deltas from the "
                "experts' delta stores, built by `analyze --store-deltas`; keeps the most quality per byte) "
                "[default: entries when every expert has a delta store and the budget leaves something "
                "unread, else energy].",
            ),
            click.option("--out-dtype", default=None, help="Output dtype (bf16, f16, f32) [default: the base's]."),
            click.option(
                "--out-shard-size",
                default=None,
                help="Largest output shard, e.g. 5GB (model-0000i-of-0000N.safetensors plus an index, as "
                "transformers writes) [default: the base's sharding].",
            ),
            click.option(
                "--from",
                "previous",
                default=None,
                metavar="SNAPSHOT",
                help="Merge incrementally: copy the output blocks whose inputs are unchanged from this "
                "snapshot (a snapshot id, or a merged model id: its latest version). Bit-identical to "
                "merging from scratch; reads experts only for what changed.",
            ),
            click.option(
                "--delta-update",
                is_flag=True,
                default=None,
                help="With --from, for linear/avg/task_arithmetic: update blocks whose only change is a new "
                "version of an expert from the previous output (reads that expert's old and new blocks "
                "only). Not bit-identical; the plan's error bound includes the rounding.",
            ),
            NO_PROGRESS_OPTION,
            click.option(
                "--strict",
                is_flag=True,
                help="Refuse a plan whose output equals the base (a budget that reads nothing, or experts "
                "identical to the base) instead of warning.",
            ),
            click.option(
                "--analyze-missing/--no-analyze-missing",
                default=True,
                show_default=True,
                help="Experts not yet analysed against the base: analyse them first (reads each such expert once, "
                "in full), or with --no-analyze-missing refuse instead.",
            ),
        ],
    )


def _not_cuda(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        raise ConfigError(
            "no such option --cuda: MergePipe's is --device cuda (`mergepipe-yaml CONFIG OUT --cuda` "
            "takes mergekit-yaml's flag as it is)"
        )


#: mergekit-yaml's ``--cuda`` given to `plan`, `merge` or `execute`: one line pointing to ``--device cuda``.
CUDA_TYPO_OPTION = click.option(
    "--cuda",
    is_flag=True,
    hidden=True,
    expose_value=False,
    callback=_not_cuda,
    help="mergekit-yaml's flag, refused here: use --device cuda.",
)


def execution_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where and how the merge runs: device, memory bound, and the executor of its work units."""
    return _apply(
        func,
        [
            click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
            CUDA_TYPO_OPTION,
            click.option(
                "--max-memory",
                default=DEFAULT_MAX_MEMORY,
                show_default=True,
                help="Bound on the engine's buffers (streaming operators).",
            ),
            click.option(
                "--executor",
                type=click.Choice(["local", "ray"]),
                default="local",
                show_default=True,
                help="Where work units run: threads of this process, or tasks on a Ray cluster "
                f"(`{RAY_INSTALL_HINT}`; the checkpoints, the catalog's delta stores and --out must be on a "
                "filesystem every worker sees, or the checkpoints in object storage). The output is the "
                "same bytes and snapshot either way.",
            ),
            click.option(
                "--ray-address",
                default=None,
                metavar="ADDRESS",
                help="With --executor ray: auto (the cluster `ray start` joined this machine to), "
                "ray://HOST:PORT (Ray client), HOST:PORT, or local (a Ray instance for this command only) "
                "[default: $RAY_ADDRESS, else local].",
            ),
            click.option(
                "--workers",
                type=click.IntRange(min=1),
                default=None,
                help="Work units run at once: threads (local), or Ray tasks of one core each "
                "[default: 1 thread; with Ray, the cluster's cores].",
            ),
        ],
    )


def output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where a merge publishes its snapshot, and its cost summary."""
    return _apply(
        func,
        [
            click.option(
                "--out", required=True, type=click.Path(path_type=Path), help="Output directory (must not exist)."
            ),
            click.option(
                "--model-id",
                default=None,
                help="Id of the merged model in the catalog [merge: default the --out folder's name, with a "
                "hash of its path if another folder published that name]. A plan "
                "executed before gives the same snapshot, re-materialised at --out: as its own model, or "
                "under another id as an alias of it (`lineage ID` says which).",
            ),
            click.option(
                "--json-summary",
                type=click.Path(dir_okay=False, path_type=Path),
                help="Also write the cost summary as JSON here (bytes, seconds, and this command's CPU "
                "seconds, peak RSS and disk I/O); an existing file is refused unless --force.",
            ),
            click.option(
                "--force",
                is_flag=True,
                help="Overwrite an existing --json-summary file (never the catalog "
                "nor a checkpoint: --out must not exist).",
            ),
        ],
    )


def request_from(kwargs: dict[str, Any]) -> MergeRequest:
    """The merge request the options ask for: flags over ``--config`` over the defaults."""
    config = None if kwargs.get("config_path") is None else read_config(kwargs["config_path"])
    flags = {name: kwargs.get(name) for name in FIELD_FLAGS}
    flags["out_shard_bytes"] = parse_shard_bytes(kwargs.get("out_shard_size"))  # checked as text, as typed
    flags["params"] = {d.name: kwargs[d.attribute] for d in FLAGS if kwargs.get(d.attribute) is not None}
    return merge_request(flags, config)

"""The snapshot reports: verify, explain, diff. Each is one call of ``app/examine.py`` and a rendering of
what it returns; none of them loads torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from mergepipe.app import examine
from mergepipe.catalog.location import Location
from mergepipe.cli.common import CATALOG, DB_OPTION, JSON_OPTION, default_db, echo, plain_console, predicted_text
from mergepipe.manifest.manifest import MANIFEST_FILENAME
from mergepipe.planner.evaluations import DIGEST_CHARS, delta_text, params_text, value_text
from mergepipe.planner.diff import SnapshotDiff
from mergepipe.planner.explain import Explanation, copies_in_write, output_text, time_rows
from mergepipe.sizes import format_bytes

_FORCE = click.option("--force", is_flag=True, help="Overwrite an existing --html file (never the catalog, "
                      "nor one inside a registered model or snapshot).")


@click.command("verify")
@click.option("--db", "db_path", type=CATALOG,
              help="Catalog of a snapshot id or merged model id [default: the default catalog, as --db of "
              "the other commands]; a directory needs none.")
@click.argument("target")
@JSON_OPTION
def verify_cmd(db_path: Location | None, target: str, as_json: bool) -> None:
    """Recompute every file hash and the manifest hash of a snapshot (id or directory)."""
    if db_path is None and not Path(target).is_dir() and not _written_as_path(target):
        db_path = default_db()  # a snapshot or model id: looked up in the default catalog
    report = examine.verify(target, db_path)
    if as_json:  # the report on stdout; a failure still exits non-zero with its one line on stderr
        manifest = report.manifest
        click.echo(json.dumps({
            "path": str(report.path), "ok": report.ok, "files_checked": report.files_checked,
            "checked": report.checked,
            "problems": report.problems, "notes": report.notes,
            "snapshot_id": manifest.snapshot_id if manifest else None,
            "manifest_hash": manifest.manifest_hash if manifest else None,
        }, indent=2))
    report.raise_for_problems()
    if as_json:
        return
    derived = " and ".join(report.derived_checked)
    echo(f"OK {report.path}: {len(report.checked)} files verified: the {report.files_checked} the manifest "
         f"lists (hash and size), {MANIFEST_FILENAME} (its hash "
         f"{report.manifest.manifest_hash if report.manifest else ''})"
         + (f", {derived} (as the manifest describes them)" if derived and not report.notes else
                  f", {derived}" if derived else ""))
    for note in report.notes:
        echo(f"note: {note}")


def _written_as_path(target: str) -> bool:
    """Whether ``target`` can only be a folder (ids never hold a path separator): one that is not there is
    said to be missing, not looked up in a catalog."""
    return "/" in target or os.sep in target or Path(target).exists()


@click.command("explain")
@DB_OPTION
@click.argument("target")
@click.option("--tensor", default=None, help="Only tensors whose name contains this.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the explanation to this file as one self-contained HTML page (summary, scores where "
                   "the merge was evaluated, heatmaps layers x experts, bytes per expert, lineage graph, tensors "
                   "with the most omitted energy; no network) instead of printing tables. An existing file is "
                   "refused unless --force.")
@_FORCE
@JSON_OPTION
def explain_cmd(db_path: Path, target: str, tensor: str | None, html_path: Path | None, force: bool,
                as_json: bool) -> None:
    """Where the budget went: per tensor and per expert.

    TARGET is a snapshot id (or unique prefix), a merged model id, or a plan id (or prefix).
    """
    result = examine.explain(db_path, target, tensor=tensor, html=html_path, force=force)
    if html_path is not None:
        echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))
    elif html_path is None:
        _print_explanation(result)


def _print_explanation(result: Explanation) -> None:
    console = plain_console()
    shown = "" if result.tensor_filter is None else "; the summary is the whole plan's"
    head = Table(title=f"{'snapshot ' + result.snapshot_id if result.snapshot_id else 'plan'} "
                 f"(plan {result.plan_id[:12]}, {result.operator}, {result.policy}){shown}", show_header=False)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("budget", format_bytes(result.budget_bytes))
    realized_bytes = result.realized_expert_bytes
    realized = "" if realized_bytes is None else f", realized {format_bytes(realized_bytes)}"
    head.add_row("expert bytes", f"planned {format_bytes(result.planned_expert_bytes)} of "
                 f"{format_bytes(result.full_expert_bytes)} changed{realized}")
    if result.reused_from is not None:
        saved = sum(e.reused_bytes for e in result.experts)
        head.add_row("incremental", f"{format_bytes(result.reused_output_bytes)} of output copied from "
                     f"'{result.reused_from}'; {format_bytes(saved)} of the planned expert bytes reused, "
                     f"{format_bytes(result.planned_expert_bytes - saved)} recomputed")
        if result.updated_output_bytes:
            head.add_row("delta updates", f"{format_bytes(result.updated_output_bytes)} of output updated from the "
                         f"previous output (not bit-identical; within {result.update_bound:.4g})")
    if (made := output_text(result)) is not None:
        head.add_row("output", made)
    head.add_row("delta energy (‖Δ‖²) kept", f"{100 * result.retained_energy:.1f}% of the weighted delta energy "
                 "Σ (w‖Δ‖)² is read (w: each expert's weight)")
    head.add_row("error bound", f"{result.error_bound:.6g} ({result.error_bound_kind}; Frobenius, on the fp32 result "
                 "before rounding to the output dtype, whose rounding alone may be larger)")
    if result.estimate is not None:
        head.add_row("deviation estimate", f"{result.estimate:.6g} (first order: the weighted norm of what the plan "
                     "leaves out; not a bound, but it ranks plans as their measured deviation does)")
    head.add_row("weighted norm (‖Δ‖) left out", f"{100 * result.error_share:.1f}% of the weighted task vectors' norm "
                 "√Σ (β‖Δ‖)² is not read (β: the operator's error-bound multiplier)")
    head.add_row("predicted seconds", predicted_text(result.predicted))
    for label, text in time_rows(result.seconds, kernel_copies=copies_in_write(result.output_bytes_by_method)):
        head.add_row("realized " + label.strip() if label == "time" else label, text)
    if result.tensor_filter is not None:
        head.add_row("tensors shown", f"{len(result.tensors)} of {result.tensor_count} (name contains "
                     f"'{result.tensor_filter}'): {format_bytes(result.shown_planned_bytes)} planned; delta energy "
                     f"(‖Δ‖²) kept {100 * result.shown_retained_energy:.1f}%")
    console.print(head)
    for found in result.searches:
        console.print(f"found by search {found.study}: trial {found.trial} of {found.trials}, objective "
                      f"{found.objective:.4f} at budget {found.search_budget} "
                      f"({params_text(found.params, digits=4)})")
    if result.evaluations:
        console.print(_evaluations(result))
    incremental = result.reused_from is not None
    experts = Table(title="per expert" + (" (whole plan)" if result.tensor_filter is not None else ""))
    for col in ("expert", "planned", *(("reused", "recomputed") if incremental else ()), "realized",
                "changed bytes", "share"):
        experts.add_column(col, justify="right" if col != "expert" else "left")
    for e in result.experts:
        split = (format_bytes(e.reused_bytes), format_bytes(e.planned_bytes - e.reused_bytes)) if incremental else ()
        experts.add_row(e.expert, format_bytes(e.planned_bytes), *split,
                        "-" if e.realized_bytes is None else format_bytes(e.realized_bytes),
                        format_bytes(e.full_bytes), f"{100 * e.share:.1f}%")
    console.print(experts)
    only = "" if result.tensor_filter is None else f"; names containing '{result.tensor_filter}'"
    tensors = Table(title="per tensor (blocks read / changed, or the delta-store level read, per expert"
                    + ("; output blocks reused / all" if incremental else "") + f"{only})")
    tensors.add_column("tensor", overflow="fold")  # a long name wraps, never loses its end
    for e in result.experts:
        tensors.add_column(e.expert, justify="right")
    tensors.add_column("bytes", justify="right")
    if incremental:
        tensors.add_column("reused", justify="right")
    tensors.add_column("delta energy kept", justify="right")  # "-": no expert changed it
    for t in result.tensors:
        reused = (f"{t.reused_blocks}/{t.blocks}" + (f" (+{t.updated_blocks} updated)" if t.updated_blocks else ""),
                  ) if incremental else ()
        tensors.add_row(t.tensor, *[t.store.get(e.expert) or f"{t.read[e.expert]}/{t.changed[e.expert]}"
                                    for e in result.experts],
                        format_bytes(t.planned_bytes), *reused,
                        f"{100 * t.retained_energy:.0f}%" if any(t.energy.values()) else "-")
    console.print(tensors)


def _evaluations(result: Explanation) -> Table:
    """What the merge scored, by data and metric (stored under its plan digest)."""
    table = Table(title=f"evaluations (of plan {result.plan_id[:12]}'s merge)")
    for col in ("data", "data digest", "metric", "value", "tokens"):
        table.add_column(col, overflow="fold", justify="right" if col in ("value", "tokens") else "left")
    for r in result.evaluations:
        table.add_row(r.data_name, r.data_digest[:DIGEST_CHARS], r.metric, value_text(r.value),
                      "-" if r.tokens is None else str(r.tokens))
    return table


@click.command("diff")
@DB_OPTION
@click.argument("a")
@click.argument("b")
@click.option("--top", default=20, show_default=True, type=click.IntRange(min=1),
              help="How many changed tensors to list (and chart, with --html), largest relative change first "
                   "(every tensor with --json); tensors holding the same values in both are counted, not listed.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the difference to this file as one self-contained HTML page (input differences, scores "
                   "on data both were evaluated on, a bar chart of the relative change per tensor; no network) "
                   "instead of printing it. An existing file is refused unless --force.")
@_FORCE
@JSON_OPTION
def diff_cmd(db_path: Path, a: str, b: str, top: int, html_path: Path | None, force: bool, as_json: bool) -> None:
    """What differs from snapshot A to snapshot B: inputs, and the tensors that changed most.

    A and B are snapshot ids (or unique prefixes) or merged model ids (name@N for a version).
    """
    result = examine.diff(db_path, a, b, html=html_path, top=top, force=force)
    if html_path is not None:
        echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    if html_path is not None:
        return
    console = plain_console()
    console.print(Text.assemble((result.a, "bold"), " -> ", (result.b, "bold")))
    for line in result.inputs or ["inputs: the same experts, versions, parameters and budget"]:
        console.print(f"  {line}")
    if result.evaluations:
        console.print(_score_changes(result))
    changed, total = result.changed, len(result.tensors)
    same = f"{result.unchanged} of {total} tensors hold the same values in both"
    if not changed:
        console.print(f"every tensor holds the same values in both ({total} of {total})")
        return
    shown = f"the {top} largest of {len(changed)} changed" if len(changed) > top else f"all {len(changed)} changed"
    table = Table(title=f"tensors by relative change ‖B − A‖ / ‖A‖: {shown}; {same}")
    for column in ("tensor", "relative change", "experts whose planned blocks differ"):
        table.add_column(column, overflow="fold")
    for t in changed[:top]:
        table.add_row(t.tensor, f"{t.relative_change:.3e}", ", ".join(t.experts) or "-")
    console.print(table)


def _score_changes(result: SnapshotDiff) -> Table:
    """Each metric of A and B on data both were evaluated on, and B − A."""
    table = Table(title="evaluations on data both were evaluated on")
    for col in ("data", "data digest", "metric", "A", "B", "B − A"):
        table.add_column(col, overflow="fold", justify="right" if col in ("A", "B", "B − A") else "left")
    for c in result.evaluations:
        table.add_row(c.data_name, c.data_digest[:DIGEST_CHARS], c.metric, value_text(c.a), value_text(c.b),
                      delta_text(c.delta))
    return table


COMMANDS = [verify_cmd, explain_cmd, diff_cmd]

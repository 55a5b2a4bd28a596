"""The snapshot reports: verify, explain, diff. Each is one call of ``app/examine.py`` and a rendering of
what it returns; none of them loads torch."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from mergepipe.app import examine
from mergepipe.cli.common import DB_OPTION, JSON_OPTION, plain_console, predicted_text
from mergepipe.planner.explain import Explanation
from mergepipe.sizes import format_bytes

_FORCE = click.option("--force", is_flag=True, help="Overwrite an existing --html file (never one inside a "
                      "registered model or snapshot).")


@click.command("verify")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Catalog file (needed to verify by snapshot id or merged model id).")
@click.argument("target")
@JSON_OPTION
def verify_cmd(db_path: Path | None, target: str, as_json: bool) -> None:
    """Recompute every file hash and the manifest hash of a snapshot (id or directory)."""
    report = examine.verify(target, db_path)
    if as_json:  # the report on stdout; a failure still exits non-zero with its one line on stderr
        manifest = report.manifest
        click.echo(json.dumps({
            "path": str(report.path), "ok": report.ok, "files_checked": report.files_checked,
            "problems": report.problems, "snapshot_id": manifest.snapshot_id if manifest else None,
            "manifest_hash": manifest.manifest_hash if manifest else None,
        }, indent=2))
    report.raise_for_problems()
    if as_json:
        return
    click.echo(f"OK {report.path}: {report.files_checked} files and the manifest hash verified "
               f"({report.manifest.manifest_hash if report.manifest else ''})")


@click.command("explain")
@DB_OPTION
@click.argument("target")
@click.option("--tensor", default=None, help="Only tensors whose name contains this.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the explanation to this file as one self-contained HTML page (summary, heatmaps "
                   "layers x experts, bytes per expert, lineage graph, tensors with the most omitted energy; no "
                   "network) instead of printing tables. An existing file is refused unless --force.")
@_FORCE
@JSON_OPTION
def explain_cmd(db_path: Path, target: str, tensor: str | None, html_path: Path | None, force: bool,
                as_json: bool) -> None:
    """Where the budget went: per tensor and per expert.

    TARGET is a snapshot id (or unique prefix), a merged model id, or a plan id (or prefix).
    """
    result = examine.explain(db_path, target, tensor=tensor, html=html_path, force=force)
    if html_path is not None:
        click.echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))
    elif html_path is None:
        _print_explanation(result)


def _print_explanation(result: Explanation) -> None:
    console = plain_console()
    head = Table(title=f"{'snapshot ' + result.snapshot_id if result.snapshot_id else 'plan'} "
                 f"(plan {result.plan_id[:12]}, {result.operator}, {result.policy})", show_header=False)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("budget", format_bytes(result.budget_bytes))
    realized_bytes = result.realized_expert_bytes
    realized = "" if realized_bytes is None else f", realized {format_bytes(realized_bytes)}"
    head.add_row("expert bytes", f"planned {format_bytes(result.planned_expert_bytes)} of "
                 f"{format_bytes(result.full_expert_bytes)}{realized}")
    if result.reused_from is not None:
        saved = sum(e.reused_bytes for e in result.experts)
        head.add_row("incremental", f"{format_bytes(result.reused_output_bytes)} of output copied from "
                     f"'{result.reused_from}'; {format_bytes(saved)} of the planned expert bytes reused, "
                     f"{format_bytes(result.planned_expert_bytes - saved)} recomputed")
        if result.updated_output_bytes:
            head.add_row("delta updates", f"{format_bytes(result.updated_output_bytes)} of output updated from the "
                         f"previous output (not bit-identical; within {result.update_bound:.4g})")
    head.add_row("retained delta energy", f"{100 * result.retained_energy:.1f}%")
    head.add_row("error bound", f"{result.error_bound:.6g} ({result.error_bound_kind}); "
                 f"{100 * result.error_share:.1f}% of the weighted task vectors (norm) left out")
    head.add_row("predicted seconds", predicted_text(result.predicted))
    if result.seconds:
        head.add_row("realized seconds", " · ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()))
    console.print(head)
    incremental = result.reused_from is not None
    experts = Table(title="per expert")
    for col in ("expert", "planned", *(("reused", "recomputed") if incremental else ()), "realized",
                "changed bytes", "share"):
        experts.add_column(col, justify="right" if col != "expert" else "left")
    for e in result.experts:
        split = (format_bytes(e.reused_bytes), format_bytes(e.planned_bytes - e.reused_bytes)) if incremental else ()
        experts.add_row(e.expert, format_bytes(e.planned_bytes), *split,
                        "-" if e.realized_bytes is None else format_bytes(e.realized_bytes),
                        format_bytes(e.full_bytes), f"{100 * e.share:.1f}%")
    console.print(experts)
    tensors = Table(title="per tensor (blocks read / changed, or the delta-store level read, per expert"
                    + ("; output blocks reused / all" if incremental else "") + ")")
    tensors.add_column("tensor", overflow="fold")  # a long name wraps, never loses its end
    for e in result.experts:
        tensors.add_column(e.expert, justify="right")
    tensors.add_column("bytes", justify="right")
    if incremental:
        tensors.add_column("reused", justify="right")
    tensors.add_column("energy kept", justify="right")
    for t in result.tensors:
        reused = (f"{t.reused_blocks}/{t.blocks}" + (f" (+{t.updated_blocks} updated)" if t.updated_blocks else ""),
                  ) if incremental else ()
        tensors.add_row(t.tensor, *[t.store.get(e.expert) or f"{t.read[e.expert]}/{t.changed[e.expert]}"
                                    for e in result.experts],
                        format_bytes(t.planned_bytes), *reused, f"{100 * t.retained_energy:.0f}%")
    console.print(tensors)


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
@_FORCE
@JSON_OPTION
def diff_cmd(db_path: Path, a: str, b: str, top: int, html_path: Path | None, force: bool, as_json: bool) -> None:
    """What differs from snapshot A to snapshot B: inputs, and the tensors that changed most.

    A and B are snapshot ids (or unique prefixes) or merged model ids (name@N for a version).
    """
    result = examine.diff(db_path, a, b, html=html_path, top=top, force=force)
    if html_path is not None:
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


COMMANDS = [verify_cmd, explain_cmd, diff_cmd]

"""The catalog views: models, show, snapshots, lineage. Each is one call of ``app/views.py`` and a rendering
of what it returns; light: none of them loads torch."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from mergepipe.app import views
from mergepipe.app.reports import (
    DIGEST_CHARS,
    EvaluatedData,
    Explanation,
    SnapshotDiff,
    compact,
    delta_text,
    output_text,
    params_text,
    time_rows,
    value_text,
)
from mergepipe.catalog.database import Location
from mergepipe.catalog.records import EvaluationRecord
from mergepipe.cli.common import CATALOG, DB_OPTION, FORCE_HTML_OPTION, JSON_OPTION, default_db, echo, echo_json
from mergepipe.cli.common import plain_console, summary_table, table
from mergepipe.manifest.manifest import MANIFEST_FILENAME
from mergepipe.sizes import format_bytes
from mergepipe.spec.plan import describe


@click.command("models")
@DB_OPTION
@JSON_OPTION
def models_cmd(db_path: Path, as_json: bool) -> None:
    """List registered models with size, counts and analysis state."""
    rows = views.models(db_path)
    if as_json:
        echo_json([{**m.model_dump(), "status": s.model_dump()} for m, s in rows])
        return
    if not rows:
        echo("no models registered yet (register one with `mergepipe register`)")
        return
    columns = ("id", "version", "kind", "architecture", "layers", "size", "tensors", "blocks", "analysis")
    cells = [
        (
            m.id,
            m.label,
            m.kind,
            m.architecture or "-",
            "-" if m.num_layers is None else str(m.num_layers),
            format_bytes(m.total_bytes),
        )
        + (str(m.n_tensors), str(m.n_blocks), s.describe())
        for m, s in rows
    ]
    plain_console().print(table(f"models in {db_path}", columns, cells))


@click.command("show")
@DB_OPTION
@JSON_OPTION
@click.argument("model_id")
def show_cmd(db_path: Path, as_json: bool, model_id: str) -> None:
    """Show one model: files, tensors, parents and analyses."""
    view = views.show(db_path, model_id)
    record, status, files, tensors, blocks = view.record, view.status, view.files, view.tensors, view.blocks
    history = view.history
    if as_json:
        echo_json(
            {
                **record.model_dump(),
                "content_fingerprint": view.content_fingerprint,
                "status": status.model_dump(),
                "files": [f.model_dump() for f in files],
                "parents": [{"id": p, "role": r} for p, r in view.parents],
                "analyses": [a.model_dump() for a in view.analyses],
                "tensors": [{**asdict(t), "blocks": blocks.get(t.name, 0)} for t in tensors],
                "versions": [
                    {
                        "id": v.id,
                        "version": v.version,
                        "created_at": v.created_at,
                        "changes": None if c is None else c.describe(),
                    }
                    for v, c in history
                ],
            }
        )
        return
    console = plain_console()
    against = f" against '{record.delta_base}'" if record.delta_base else ""  # a delta or a LoRA adapter
    console.print(Text.assemble((record.id, "bold"), f" ({record.kind}{against}, {record.label}) at {record.uri}"))
    layers = record.num_layers if record.num_layers is not None else "-"
    console.print(
        f"architecture {record.architecture or '-'}, layers {layers}, "
        f"{format_bytes(record.total_bytes)} in {len(files)} file(s), {record.n_tensors} tensors, "
        f"{record.n_blocks} blocks; registered {record.created_at}"
    )
    console.print(
        f"content fingerprint {view.content_fingerprint} (its bytes: what plans and manifests record)"
        if view.content_fingerprint
        else "content fingerprint not computed yet (its blocks are not hashed; `mergepipe analyze` hashes them)"
    )
    console.print(
        f"layout fingerprint {record.fingerprint} (file names, headers and sizes: the same for every "
        "version that keeps the layout)"
    )
    console.print(f"analysis: {status.describe()}")
    if view.parents:
        console.print("parents: " + ", ".join(f"{p} ({r})" for p, r in view.parents))
    if len(history) > 1:
        columns = ("version", "id", "registered", "changes from the previous version")
        changes = [(str(v.version), v.id, v.created_at, "-" if c is None else c.describe()) for v, c in history]
        console.print(table(f"versions of '{record.name}'", columns, changes))
    rows = [
        (t.name, t.dtype, "×".join(map(str, t.shape)) or "scalar", format_bytes(t.nbytes))
        + (str(blocks.get(t.name, 0)), t.file)
        for t in tensors
    ]
    console.print(table("tensors", ("name", "dtype", "shape", "size", "blocks", "file"), rows))


@click.command("snapshots")
@DB_OPTION
@JSON_OPTION
def snapshots_cmd(db_path: Path, as_json: bool) -> None:
    """List publish attempts: committed snapshots, pending and aborted intents.

    A committed snapshot lists every directory it was published to (executing its plan again
    re-materialises it at another one), whether each exists on disk now (or was removed with
    `mergepipe rm`), and which one is current (its model's uri: what `verify` by id, `--from` and
    `diff` read), then the Hugging Face Hub commits it was pushed to (`mergepipe push`), as
    hf://ORG/NAME@COMMIT. Pending and aborted re-materialisations are listed as attempts.
    """
    found = views.snapshots(db_path)
    if as_json:
        echo_json(
            [
                {
                    **v.record.model_dump(),
                    "locations": v.locations,
                    "location_intents": v.attempts,
                    "hub_locations": [h.model_dump() for h in v.hub],
                }
                for v in found
            ]
        )
        return
    rows: list[tuple[str, ...]] = []
    for view in found:
        r = view.record
        several = len(view.locations) > 1
        paths = [
            f"{loc['path']}{' (current)' if several and loc['current'] and loc['removed_at'] is None else ''}"
            f"{_gone(loc)}"
            for loc in view.locations
        ]
        paths += [_pushed(hub.model_dump()) for hub in view.hub]
        first = (r.id or "-", r.model_id)
        rows.append((*first, r.status, r.plan_id[:12], "\n".join(paths) or r.out_path, (r.manifest_hash or "-")[:16]))
        rows += [(*first, f"{a['status']} (re-run)", r.plan_id[:12], a["path"], "-") for a in view.attempts]
    columns = ("snapshot", "model", "status", "plan", "path", "manifest hash")
    plain_console().print(table(f"snapshots in {db_path}", columns, rows))


def _pushed(hub: dict) -> str:
    """A Hub location (``HubPush.model_dump``): its URI, when it was pushed and to which branch."""
    private = ", private" if hub["private"] else ""
    return f"{hub['uri']} (pushed {hub['pushed_at']} to branch {hub['revision']}{private})"


def _gone(location: dict) -> str:
    """How a location's directory is missing: removed with `mergepipe rm` or replaced (when), or deleted otherwise."""
    if location["removed_at"] is not None:
        replaced = os.path.isfile(os.path.join(location["path"], MANIFEST_FILENAME))  # another snapshot is there
        how = "replaced by another snapshot" if replaced else "removed with `mergepipe rm`"
        return f" (missing: {how} {location['removed_at']})"
    return "" if location["exists"] else " (missing)"


@click.command("lineage")
@DB_OPTION
@click.argument("model_id")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "dot", "json"]),
    default="text",
    show_default=True,
    help="text: a tree; dot: a Graphviz digraph (edges from parent to child); json: nested nodes, "
    "with every stored score.",
)
def lineage_cmd(db_path: Path, model_id: str, fmt: str) -> None:
    """The tree of a model's parents (base and experts, with their versions), recursively; for a
    merged model also its earlier versions. Where models were evaluated, each shows its scores on the
    data evaluated for the most of them. MODEL_ID is a name (its latest version) or name@N."""
    root = views.lineage(db_path, model_id)
    pushed = root.get("hub_locations", [])
    if fmt == "json":
        echo_json(root, sort_keys=False)
    elif fmt == "dot":
        copies = [f'  {json.dumps(root["label"])} -> {json.dumps(h["uri"])} [label="pushed"];' for h in pushed]
        echo("\n".join(["digraph lineage {", "  rankdir=BT;", *_dot_edges(root), *copies, "}"]))
    else:
        data = (
            EvaluatedData(root["evaluated_on"]["data_digest"], root["evaluated_on"]["data_name"])
            if "evaluated_on" in root
            else None
        )
        tree = Tree(Text.assemble((root["label"], "bold"), _notes(root, data)))
        _add_nodes(tree, root["parents"], data)
        plain_console().print(tree)
        if data is not None:
            echo(
                f"scores on {data.name} (data {data.digest[:DIGEST_CHARS]}): the data evaluated for the "
                "most of these models; `--format json` has every score"
            )
        for hub in pushed:
            echo(f"on the Hub: {_pushed(hub)}")


def _add_nodes(tree: Tree, nodes: list[dict], data: EvaluatedData | None) -> None:
    for node in nodes:
        branch = tree.add(Text.assemble(node["label"], (f" ({node['role']})", "dim"), _notes(node, data)))
        _add_nodes(branch, node["parents"], data)


def _notes(node: dict, data: EvaluatedData | None) -> str:
    """``  loss=2.5 perplexity=12.1825``: what the node's model scored on ``data``, if it was; then
    ``  [best of search S: trial 7 of 40]`` for a snapshot a `mergepipe search` published."""
    text = "" if data is None else compact([EvaluationRecord(**row) for row in node.get("evaluations", [])], data)
    searched = (
        f"  [best of search {s['study']}: trial {s['trial']} of {s['trials']}]" for s in node.get("searches", [])
    )
    return (f"  {text}" if text else "") + "".join(searched)


def _dot_edges(node: dict) -> list[str]:
    """``"parent" -> "child" [label=role];`` for every edge under ``node``, each once."""
    edges: list[str] = []
    for parent in node["parents"]:
        edge = f"  {json.dumps(parent['label'])} -> {json.dumps(node['label'])} [label={json.dumps(parent['role'])}];"
        if edge not in edges:
            edges.append(edge)
        edges += [e for e in _dot_edges(parent) if e not in edges]
    return edges


@click.command("verify")
@click.option(
    "--db",
    "db_path",
    type=CATALOG,
    help="Catalog of a snapshot id or merged model id [default: the default catalog, as --db of "
    "the other commands]; a directory needs none.",
)
@click.argument("target")
@JSON_OPTION
def verify_cmd(db_path: Location | None, target: str, as_json: bool) -> None:
    """Recompute every file hash and the manifest hash of a snapshot (id or directory)."""
    if db_path is None and not Path(target).is_dir() and not _written_as_path(target):
        db_path = default_db()  # a snapshot or model id: looked up in the default catalog
    report = views.verify(target, db_path)
    manifest = report.manifest
    if as_json:  # the report on stdout; a failure still exits non-zero with its one line on stderr
        fields = ("ok", "files_checked", "checked", "problems", "notes")
        found: dict[str, str | None] = {"snapshot_id": None, "manifest_hash": None}
        if manifest is not None:
            found = {"snapshot_id": manifest.snapshot_id, "manifest_hash": manifest.manifest_hash}
        echo_json({"path": str(report.path), **{f: getattr(report, f) for f in fields}, **found}, sort_keys=False)
    report.raise_for_problems()
    if as_json:
        return
    derived = " and ".join(report.derived_checked)
    derived += " (as the manifest describes them)" if derived and not report.notes else ""
    echo(
        f"OK {report.path}: {len(report.checked)} files verified: the {report.files_checked} the manifest "
        f"lists (hash and size), {MANIFEST_FILENAME} (its hash {manifest.manifest_hash if manifest else ''})"
        + (f", {derived}" if derived else "")
    )
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
@click.option(
    "--html",
    "html_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the explanation to this file as one self-contained HTML page (summary, scores where "
    "the merge was evaluated, heatmaps layers x experts, bytes per expert, lineage graph, tensors "
    "with the most omitted energy; no network) instead of printing tables. An existing file is "
    "refused unless --force.",
)
@FORCE_HTML_OPTION
@JSON_OPTION
def explain_cmd(
    db_path: Path, target: str, tensor: str | None, html_path: Path | None, force: bool, as_json: bool
) -> None:
    """Where the budget went: per tensor and per expert.

    TARGET is a snapshot id (or unique prefix), a merged model id, or a plan id (or prefix).
    """
    result = views.explain(db_path, target, tensor=tensor, html=html_path, force=force)
    if html_path is not None:
        echo(f"wrote {html_path}", err=True)
    if as_json:
        echo_json(result.to_json())
    elif html_path is None:
        _print_explanation(result)


def _print_explanation(result: Explanation) -> None:
    console = plain_console()
    shown = "" if result.tensor_filter is None else "; the summary is the whole plan's"
    realized = result.realized_expert_bytes
    rows = [
        ("budget", format_bytes(result.budget_bytes)),
        (
            "expert bytes",
            f"planned {format_bytes(result.planned_expert_bytes)} of {format_bytes(result.full_expert_bytes)} "
            f"changed{'' if realized is None else f', realized {format_bytes(realized)}'}",
        ),
    ]
    if result.reused_from is not None:
        saved = sum(e.reused_bytes for e in result.experts)
        rows.append(
            (
                "incremental",
                f"{format_bytes(result.reused_output_bytes)} of output copied from '{result.reused_from}'; "
                f"{format_bytes(saved)} of the planned expert bytes reused, "
                f"{format_bytes(result.planned_expert_bytes - saved)} recomputed",
            )
        )
        if result.updated_output_bytes:
            rows.append(
                (
                    "delta updates",
                    f"{format_bytes(result.updated_output_bytes)} of output updated from the previous output "
                    f"(not bit-identical; within {result.update_bound:.4g})",
                )
            )
    if (made := output_text(result.output_bytes_by_method, result.reused_snapshot, result.reused_from)) is not None:
        rows.append(("output", made))
    rows += [
        (
            "delta energy (‖Δ‖²) kept",
            f"{100 * result.retained_energy:.1f}% of the weighted delta energy Σ (w‖Δ‖)² is read (w: each "
            "expert's weight)",
        ),
        (
            "error bound",
            f"{result.error_bound:.6g} ({result.error_bound_kind}; Frobenius, on the fp32 result before rounding "
            "to the output dtype, whose rounding alone may be larger)",
        ),
    ]
    if result.estimate is not None:
        rows.append(
            (
                "deviation estimate",
                f"{result.estimate:.6g} (first order: the weighted norm of what the plan leaves out; not a bound, "
                "but it ranks plans as their measured deviation does)",
            )
        )
    rows.append(
        (
            "weighted norm (‖Δ‖) left out",
            f"{100 * result.error_share:.1f}% of the weighted task vectors' norm √Σ (β‖Δ‖)² is not read (β: the "
            "operator's error-bound multiplier)",
        )
    )
    rows.append(("predicted seconds", describe(result.predicted)))
    for label, text in time_rows(result.seconds, result.output_bytes_by_method):
        rows.append(("realized " + label.strip() if label == "time" else label, text))
    if result.tensor_filter is not None:
        rows.append(
            (
                "tensors shown",
                f"{len(result.tensors)} of {result.tensor_count} (name contains '{result.tensor_filter}'): "
                f"{format_bytes(result.shown_planned_bytes)} planned; delta energy (‖Δ‖²) kept "
                f"{100 * result.shown_retained_energy:.1f}%",
            )
        )
    title = "snapshot " + result.snapshot_id if result.snapshot_id else "plan"
    console.print(
        summary_table(f"{title} (plan {result.plan_id[:12]}, {result.operator}, {result.policy}){shown}", rows, None)
    )
    for found in result.searches:
        console.print(
            f"found by search {found.study}: trial {found.trial} of {found.trials}, objective "
            f"{found.objective:.4f} at budget {found.search_budget} ({params_text(found.params, digits=4)})"
        )
    if result.evaluations:
        scores = [
            (
                r.data_name,
                r.data_digest[:DIGEST_CHARS],
                r.metric,
                value_text(r.value),
                "-" if r.tokens is None else str(r.tokens),
            )
            for r in result.evaluations
        ]
        columns = ("data", "data digest", "metric", "value", "tokens")
        title = f"evaluations (of plan {result.plan_id[:12]}'s merge)"
        console.print(table(title, columns, scores, right=("value", "tokens")))
    incremental = result.reused_from is not None
    split = ("reused", "recomputed") if incremental else ()
    per_expert = [
        (e.expert, format_bytes(e.planned_bytes))
        + ((format_bytes(e.reused_bytes), format_bytes(e.planned_bytes - e.reused_bytes)) if incremental else ())
        + ("-" if e.realized_bytes is None else format_bytes(e.realized_bytes), format_bytes(e.full_bytes))
        + (f"{100 * e.share:.1f}%",)
        for e in result.experts
    ]
    columns = ("expert", "planned", *split, "realized", "changed bytes", "share")
    title = "per expert" + (" (whole plan)" if result.tensor_filter is not None else "")
    console.print(table(title, columns, per_expert, right=columns[1:]))
    experts = [e.expert for e in result.experts]
    per_tensor = []
    for t in result.tensors:
        reused = f"{t.reused_blocks}/{t.blocks}" + (f" (+{t.updated_blocks} updated)" if t.updated_blocks else "")
        per_tensor.append(
            (t.tensor, *[t.store.get(e) or f"{t.read[e]}/{t.changed[e]}" for e in experts])
            + (format_bytes(t.planned_bytes), *((reused,) if incremental else ()))
            + (f"{100 * t.retained_energy:.0f}%" if any(t.energy.values()) else "-",)  # "-": no expert changed it
        )
    columns = ("tensor", *experts, "bytes", *(("reused",) if incremental else ()), "delta energy kept")
    only = "" if result.tensor_filter is None else f"; names containing '{result.tensor_filter}'"
    title = (
        "per tensor (blocks read / changed, or the delta-store level read, per expert"
        + ("; output blocks reused / all" if incremental else "")
        + f"{only})"
    )
    console.print(table(title, columns, per_tensor, right=columns[1:]))


@click.command("diff")
@DB_OPTION
@click.argument("a")
@click.argument("b")
@click.option(
    "--top",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many changed tensors to list (and chart, with --html), largest relative change first "
    "(every tensor with --json); tensors holding the same values in both are counted, not listed.",
)
@click.option(
    "--html",
    "html_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the difference to this file as one self-contained HTML page (input differences, scores "
    "on data both were evaluated on, a bar chart of the relative change per tensor; no network) "
    "instead of printing it. An existing file is refused unless --force.",
)
@FORCE_HTML_OPTION
@JSON_OPTION
def diff_cmd(db_path: Path, a: str, b: str, top: int, html_path: Path | None, force: bool, as_json: bool) -> None:
    """What differs from snapshot A to snapshot B: inputs, and the tensors that changed most.

    A and B are snapshot ids (or unique prefixes) or merged model ids (name@N for a version).
    """
    result = views.diff(db_path, a, b, html=html_path, top=top, force=force)
    if html_path is not None:
        echo(f"wrote {html_path}", err=True)
    if as_json:
        echo_json(result.to_json(), sort_keys=False)
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
    rows = [(t.tensor, f"{t.relative_change:.3e}", ", ".join(t.experts) or "-") for t in changed[:top]]
    columns = ("tensor", "relative change", "experts whose planned blocks differ")
    console.print(table(f"tensors by relative change ‖B − A‖ / ‖A‖: {shown}; {same}", columns, rows))


def _score_changes(result: SnapshotDiff) -> Table:
    """Each metric of A and B on data both were evaluated on, and B − A."""
    rows = [
        (c.data_name, c.data_digest[:DIGEST_CHARS], c.metric, value_text(c.a), value_text(c.b), delta_text(c.delta))
        for c in result.evaluations
    ]
    columns = ("data", "data digest", "metric", "A", "B", "B − A")
    return table("evaluations on data both were evaluated on", columns, rows, right=columns[3:])


COMMANDS = [models_cmd, show_cmd, snapshots_cmd, lineage_cmd, verify_cmd, explain_cmd, diff_cmd]

"""Snapshot views: verify, explain, snapshots, lineage. Light: they do not load torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import LocationRecord, ModelRecord, SnapshotRecord
from mergepipe.cli.common import DB_OPTION as _DB, plain_console, predicted_text
from mergepipe.cli.common import JSON_OPTION as _JSON
from mergepipe.errors import ConfigError, PlanError, UnknownModelError, VerifyError
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.explain import Explanation, explain
from mergepipe.planner.html.explain_page import render_explain
from mergepipe.txn.outpath import writable_file, write_report
from mergepipe.spec.plan import Plan
from mergepipe.txn.verify import verify_snapshot
from mergepipe.units import format_bytes


@click.command("verify")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Catalog file (needed to verify by snapshot id or merged model id).")
@click.argument("target")
@_JSON
def verify_cmd(db_path: Path | None, target: str, as_json: bool) -> None:
    """Recompute every file hash and the manifest hash of a snapshot (id or directory)."""
    path = Path(target)
    if not path.is_dir():
        if db_path is None:
            raise ConfigError(f"{target} is not a directory; give --db to verify a snapshot by id")
        with Catalog.open(db_path) as catalog:
            record = _verified_record(catalog, target, db_path)
            path = Path(record.out_path)
            stored = record.manifest_hash
    else:
        stored = None
    report = verify_snapshot(path)
    if report.ok and stored is not None and report.manifest is not None and report.manifest.manifest_hash != stored:
        report.problems.append(
            f"manifest hash {report.manifest.manifest_hash[:16]} differs from the catalog's {stored[:16]}"
        )
    if as_json:  # the report on stdout; a failure still exits non-zero with its one line on stderr
        manifest = report.manifest
        click.echo(json.dumps({
            "path": str(path), "ok": report.ok, "files_checked": report.files_checked, "problems": report.problems,
            "snapshot_id": manifest.snapshot_id if manifest else None,
            "manifest_hash": manifest.manifest_hash if manifest else None,
        }, indent=2))
    report.raise_for_problems()
    if as_json:
        return
    click.echo(f"OK {path}: {report.files_checked} files and the manifest hash verified "
               f"({report.manifest.manifest_hash if report.manifest else ''})")


def _verified_record(catalog: Catalog, target: str, db_path: Path) -> SnapshotRecord:
    """The snapshot ``target`` names (a snapshot id or prefix, or a merged model id); VerifyError
    saying "missing" (not "damaged") when its current directory was deleted."""
    record = catalog.snapshots.find(target)
    if record is None:
        model = _model_or_none(catalog, target)
        record = catalog.snapshots.of_model(model.id) if model is not None else None
    if record is None:
        record = catalog.snapshots.get(target)  # the unknown-snapshot error
    if record.status == "committed" and not os.path.lexists(record.out_path):
        copies = [loc.path for loc in catalog.snapshots.locations(record.id or "") if os.path.isdir(loc.path)]
        elsewhere = f"; a copy is at {copies[0]} (verify that)" if copies else ""
        raise VerifyError(
            f"snapshot {record.id} (model '{record.model_id}') is missing: {record.out_path} no longer exists"
            f"{elsewhere}; re-materialise it with `mergepipe execute --db {db_path} --plan {record.plan_id[:12]} "
            "--out DIR`"
        )
    return record


@click.command("explain")
@_DB
@click.argument("target")
@click.option("--tensor", default=None, help="Only tensors whose name contains this.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the explanation to this file as one self-contained HTML page (summary, heatmaps "
                   "layers x experts, bytes per expert, lineage graph, tensors with the most omitted energy; no "
                   "network) instead of printing tables. An existing file is refused unless --force.")
@click.option("--force", is_flag=True, help="Overwrite an existing --html file (never one inside a registered "
              "model or snapshot).")
@_JSON
def explain_cmd(db_path: Path, target: str, tensor: str | None, html_path: Path | None, force: bool,
                as_json: bool) -> None:
    """Where the budget went: per tensor and per expert.

    TARGET is a snapshot id (or unique prefix), a merged model id, or a plan id (or prefix).
    """
    with Catalog.open(db_path) as catalog:
        if html_path is not None:
            html_path = writable_file(catalog, html_path, force, "--html")
        plan, manifest = _explain_target(catalog, target)
        result = explain(catalog, plan, manifest, tensor)
        lineage = None if html_path is None else _explained_lineage(catalog, plan, manifest)
    if html_path is not None:
        write_report(html_path, render_explain(result, lineage))
        click.echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))
    elif html_path is None:
        _print_explanation(result)


def _explain_target(catalog: Catalog, target: str) -> tuple[Plan, Manifest | None]:
    """The plan (and manifest, for a committed snapshot) that ``target`` names."""
    record = catalog.snapshots.find(target)  # an ambiguous prefix raises
    model = _model_or_none(catalog, target) if record is None else None
    if model is not None:
        target = model.id
        record = catalog.snapshots.of_model(target)
        if record is None:
            raise ConfigError(
                f"model '{target}' is not a merged snapshot; explain takes a snapshot id, "
                "a merged model id or a plan id"
            )
    if record is not None:
        plan = Plan.from_json(catalog.plans.get(record.plan_id))
        manifest = Manifest.from_json(json.loads(record.manifest)) if record.manifest else None
        return plan, manifest
    plan_id = catalog.plans.find(target)  # an ambiguous prefix raises
    if plan_id is None:
        raise PlanError(
            f"'{target}' is not a snapshot, merged model or plan of {catalog.path}; "
            "list them with `mergepipe snapshots` and `mergepipe models`"
        )
    return Plan.from_json(catalog.plans.get(plan_id)), None


def _explained_lineage(catalog: Catalog, plan: Plan, manifest: Manifest | None) -> dict:
    """Lineage nodes (as `lineage --format json`) of what explain shows: the snapshot's model, or a plan
    and its inputs; the snapshot an incremental merge was built ``--from`` is one more parent. Ids here are
    stored ids, each one exact version: looked up as they are, never resolved to a latest version."""
    model = None if manifest is None else catalog.models.find(manifest.model_id)
    if model is not None:
        root = {"id": model.id, "label": _shown(catalog, model), "role": None,
                "parents": _parents(catalog, model, seen={model.id})}
    else:
        inputs = [(plan.base.id, "base"), *((e.id, "expert") for e in plan.experts)]
        records = [(r, role) for r, role in ((catalog.models.find(i), role) for i, role in inputs) if r]
        root = {"id": plan.digest, "label": f"plan {plan.digest[:12]}", "role": None,
                "parents": [{"id": r.id, "label": _shown(catalog, r), "role": role,
                             "parents": _parents(catalog, r, seen={r.id})} for r, role in records]}
    previous = None if plan.reuse is None else catalog.models.find(plan.reuse.snapshot)
    if previous is not None and previous.id != root["id"]:
        known = next((n for n in root["parents"] if n["id"] == previous.id), None)
        if known is not None:
            known["role"] = f"{known['role']} · built --from"
        else:
            root["parents"].append({"id": previous.id, "label": _shown(catalog, previous), "role": "built --from",
                                    "parents": _parents(catalog, previous, seen={root["id"], previous.id})})
    return root


def _model_or_none(catalog: Catalog, ref: str) -> ModelRecord | None:
    """The model ``ref`` names (a name means its latest version), or None."""
    try:
        return catalog.models.resolve(ref)
    except UnknownModelError:
        return None


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


@click.command("snapshots")
@_DB
@_JSON
def snapshots_cmd(db_path: Path, as_json: bool) -> None:
    """List publish attempts: committed snapshots, pending and aborted intents.

    A committed snapshot lists every directory it was published to (executing its plan again
    re-materialises it at another one), whether each exists on disk now, and which one is current
    (its model's uri: what `verify` by id, `--from` and `diff` read). Pending and aborted
    re-materialisations are listed as attempts.
    """
    with Catalog.open(db_path) as catalog:
        records = catalog.snapshots.list()
        by_snapshot: dict[str, list[LocationRecord]] = {}
        for location in catalog.snapshots.location_intents():
            by_snapshot.setdefault(location.snapshot_id, []).append(location)
    views = [_snapshot_locations(r, by_snapshot.get(r.id or "", [])) for r in records]
    if as_json:
        click.echo(json.dumps([{**r.to_json(), **view} for r, view in zip(records, views)], indent=2, sort_keys=True))
        return
    table = Table(title=f"snapshots in {db_path}")
    for col in ("snapshot", "model", "status", "plan", "path", "manifest hash"):
        table.add_column(col)
    for r, view in zip(records, views):
        paths = [f"{loc['path']}{' (current)' if loc['current'] and len(view['locations']) > 1 else ''}"
                 f"{'' if loc['exists'] else ' (missing)'}" for loc in view["locations"]]
        table.add_row(r.id or "-", r.model_id, r.status, r.plan_id[:12], "\n".join(paths) or r.out_path,
                      (r.manifest_hash or "-")[:16])
        for attempt in view["location_intents"]:
            table.add_row(r.id or "-", r.model_id, f"{attempt['status']} (re-run)", r.plan_id[:12],
                          attempt["path"], "-")
    plain_console().print(table)


def _snapshot_locations(record: SnapshotRecord, rows: list[LocationRecord]) -> dict[str, list[dict]]:
    """A snapshot's committed locations (path, times, whether the directory exists now, whether it is
    the current one) and its other re-materialisation attempts (pending or aborted)."""
    locations = [{"path": r.path, "created_at": r.created_at, "committed_at": r.committed_at,
                  "exists": os.path.isdir(r.path), "current": r.path == record.out_path}
                 for r in rows if r.status == "committed"]
    attempts = [{"intent_id": r.intent_id, "path": r.path, "status": r.status, "created_at": r.created_at}
                for r in rows if r.status != "committed"]
    return {"locations": locations, "location_intents": attempts}


@click.command("lineage")
@_DB
@click.argument("model_id")
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "json"]), default="text", show_default=True,
              help="text: a tree; dot: a Graphviz digraph (edges from parent to child); json: nested nodes.")
def lineage_cmd(db_path: Path, model_id: str, fmt: str) -> None:
    """The tree of a model's parents (base and experts, with their versions), recursively; for a
    merged model also its earlier versions. MODEL_ID is a name (its latest version) or name@N."""
    with Catalog.open(db_path) as catalog:
        record = catalog.models.resolve(model_id)
        root = {"id": record.id, "label": _shown(catalog, record), "role": None,
                "parents": _parents(catalog, record, seen={record.id})}
    if fmt == "json":
        click.echo(json.dumps(root, indent=2))
    elif fmt == "dot":
        click.echo("\n".join(["digraph lineage {", "  rankdir=BT;", *_dot_edges(root), "}"]))
    else:
        tree = Tree(Text(root["label"], style="bold"))
        _add_nodes(tree, root["parents"])
        plain_console().print(tree)


def _shown(catalog: Catalog, record: ModelRecord) -> str:
    """A model as lineage shows it: ``name@N`` once its id has several versions, else the id."""
    return record.label if len(catalog.models.versions(record.name)) > 1 else record.id


def _parents(catalog: Catalog, record: ModelRecord, seen: set[str]) -> list[dict]:
    """A model's parents as nodes (id, label, role, their own parents), and its previous version for a
    merged model; a model already on the path is listed without its parents (no cycles)."""
    nodes = []
    for parent_id, role in catalog.models.parents(record.id):
        parent = catalog.models.get(parent_id)
        deeper = _parents(catalog, parent, seen | {parent.id}) if parent.id not in seen else []
        nodes.append({"id": parent.id, "label": _shown(catalog, parent), "role": role, "parents": deeper})
    if record.kind == "snapshot" and record.version > 1:  # the deployable model's history
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and previous.id not in seen:
            nodes.append({"id": previous.id, "label": previous.label, "role": "previous version",
                          "parents": _parents(catalog, previous, seen | {previous.id})})
    return nodes


def _add_nodes(tree: Tree, nodes: list[dict]) -> None:
    for node in nodes:
        _add_nodes(tree.add(Text.assemble(node["label"], (f" ({node['role']})", "dim"))), node["parents"])


def _dot_edges(node: dict) -> list[str]:
    """``"parent" -> "child" [label=role];`` for every edge under ``node``, each once."""
    edges: list[str] = []
    for parent in node["parents"]:
        edge = f'  {json.dumps(parent["label"])} -> {json.dumps(node["label"])} [label={json.dumps(parent["role"])}];'
        if edge not in edges:
            edges.append(edge)
        edges += [e for e in _dot_edges(parent) if e not in edges]
    return edges


COMMANDS = [verify_cmd, explain_cmd, snapshots_cmd, lineage_cmd]

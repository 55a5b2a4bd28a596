"""Snapshot views: verify, explain, snapshots, lineage. Light: they do not load torch."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord
from mergepipe.cli.common import DB_OPTION as _DB
from mergepipe.cli.common import JSON_OPTION as _JSON
from mergepipe.errors import ConfigError, PlanError, UnknownModelError
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.explain import Explanation, explain
from mergepipe.spec.plan import Plan
from mergepipe.txn.verify import verify_snapshot
from mergepipe.units import format_bytes


@click.command("verify")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Catalog file (needed to verify by snapshot id).")
@click.argument("target")
@_JSON
def verify_cmd(db_path: Path | None, target: str, as_json: bool) -> None:
    """Recompute every file hash and the manifest hash of a snapshot (id or directory)."""
    path = Path(target)
    if not path.is_dir():
        if db_path is None:
            raise ConfigError(f"{target} is not a directory; give --db to verify a snapshot by id")
        with Catalog.open(db_path) as catalog:
            record = catalog.snapshots.get(target)
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


@click.command("explain")
@_DB
@click.argument("target")
@click.option("--tensor", default=None, help="Only tensors whose name contains this.")
@_JSON
def explain_cmd(db_path: Path, target: str, tensor: str | None, as_json: bool) -> None:
    """Where the budget went: per tensor and per expert.

    TARGET is a snapshot id (or unique prefix), a merged model id, or a plan id (or prefix).
    """
    with Catalog.open(db_path) as catalog:
        plan, manifest = _explain_target(catalog, target)
        result = explain(catalog, plan, manifest, tensor)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))
        return
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


def _model_or_none(catalog: Catalog, ref: str) -> ModelRecord | None:
    """The model ``ref`` names (a name means its latest version), or None."""
    try:
        return catalog.models.resolve(ref)
    except UnknownModelError:
        return None


def _print_explanation(result: Explanation) -> None:
    console = Console()
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
    tensors.add_column("tensor")
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
    """List publish attempts: committed snapshots, pending and aborted intents."""
    with Catalog.open(db_path) as catalog:
        records = catalog.snapshots.list()
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2, sort_keys=True))
        return
    table = Table(title=f"snapshots in {db_path}")
    for col in ("snapshot", "model", "status", "plan", "path", "manifest hash"):
        table.add_column(col)
    for r in records:
        table.add_row(r.id or "-", r.model_id, r.status, r.plan_id[:12], r.out_path,
                      (r.manifest_hash or "-")[:16])
    Console().print(table)


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
        tree = Tree(f"[bold]{root['label']}[/bold]")
        _add_nodes(tree, root["parents"])
        Console().print(tree)


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
        _add_nodes(tree.add(f"{node['label']} [dim]({node['role']})[/dim]"), node["parents"])


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

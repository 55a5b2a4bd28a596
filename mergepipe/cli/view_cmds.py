"""The catalog views: models, show, snapshots, lineage. Each is one call of ``app/views.py`` and a rendering
of what it returns; light: none of them loads torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from mergepipe.app import views
from mergepipe.catalog.records import EvaluationRecord
from mergepipe.cli.common import DB_OPTION, JSON_OPTION, echo, echo_json, plain_console
from mergepipe.manifest.manifest import MANIFEST_FILENAME
from mergepipe.planner.evaluations import DIGEST_CHARS, EvaluatedData, compact
from mergepipe.sizes import format_bytes

_FORCE = click.option("--force", is_flag=True, help="Overwrite an existing --html file (never the catalog, "
                      "nor one inside a registered model or snapshot).")


@click.command("models")
@DB_OPTION
@JSON_OPTION
def models_cmd(db_path: Path, as_json: bool) -> None:
    """List registered models with size, counts and analysis state."""
    rows = views.models(db_path)
    if as_json:
        echo_json([{**m.to_json(), "status": s.to_json()} for m, s in rows])
        return
    table = Table(title=f"models in {db_path}")
    for column in ("id", "version", "kind", "architecture", "layers", "size", "tensors", "blocks", "analysis"):
        table.add_column(column, overflow="fold")
    for m, s in rows:
        table.add_row(
            m.id,
            m.label,
            m.kind,
            m.architecture or "-",
            "-" if m.num_layers is None else str(m.num_layers),
            format_bytes(m.total_bytes),
            str(m.n_tensors),
            str(m.n_blocks),
            s.describe(),
        )
    if not rows:
        echo("no models registered yet (register one with `mergepipe register`)")
        return
    plain_console().print(table)



@click.command("show")
@DB_OPTION
@JSON_OPTION
@click.argument("model_id")
def show_cmd(db_path: Path, as_json: bool, model_id: str) -> None:
    """Show one model: files, tensors, parents and analyses."""
    view = views.show(db_path, model_id)
    record, status, files, tensors, blocks = view.record, view.status, view.files, view.tensors, view.blocks
    parents, analyses, history = view.parents, view.analyses, view.history
    if as_json:
        echo_json(
            {
                **record.to_json(),
                "content_fingerprint": view.content_fingerprint,
                "status": status.to_json(),
                "files": [f.to_json() for f in files],
                "parents": [{"id": p, "role": r} for p, r in parents],
                "analyses": [a.to_json() for a in analyses],
                "tensors": [{**t.to_json(), "blocks": blocks.get(t.name, 0)} for t in tensors],
                "versions": [{"id": v.id, "version": v.version, "created_at": v.created_at,
                              "changes": None if c is None else c.describe()} for v, c in history],
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
    console.print(f"content fingerprint {view.content_fingerprint} (its bytes: what plans and manifests record)"
                  if view.content_fingerprint else
                  "content fingerprint not computed yet (its blocks are not hashed; `mergepipe analyze` hashes them)")
    console.print(f"layout fingerprint {record.fingerprint} (file names, headers and sizes: the same for every "
                  "version that keeps the layout)")
    console.print(f"analysis: {status.describe()}")
    if parents:
        console.print("parents: " + ", ".join(f"{p} ({r})" for p, r in parents))
    if len(history) > 1:
        versions = Table(title=f"versions of '{record.name}'")
        for column in ("version", "id", "registered", "changes from the previous version"):
            versions.add_column(column, overflow="fold")
        for v, c in history:
            versions.add_row(str(v.version), v.id, v.created_at, "-" if c is None else c.describe())
        console.print(versions)
    table = Table(title="tensors")
    for column in ("name", "dtype", "shape", "size", "blocks", "file"):
        table.add_column(column, overflow="fold")
    for t in tensors:
        table.add_row(
            t.name, t.dtype, "×".join(map(str, t.shape)) or "scalar", format_bytes(t.nbytes),
            str(blocks.get(t.name, 0)), t.file,
        )
    console.print(table)



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
        click.echo(json.dumps([{**v.record.to_json(), "locations": v.locations, "location_intents": v.attempts,
                                "hub_locations": [h.to_json() for h in v.hub]}
                               for v in found], indent=2, sort_keys=True))
        return
    table = Table(title=f"snapshots in {db_path}")
    for col in ("snapshot", "model", "status", "plan", "path", "manifest hash"):
        table.add_column(col)
    for view in found:
        r = view.record
        several = len(view.locations) > 1
        paths = [f"{loc['path']}{' (current)' if several and loc['current'] and loc['removed_at'] is None else ''}"
                 f"{_gone(loc)}" for loc in view.locations]
        paths += [_pushed(hub.to_json()) for hub in view.hub]
        table.add_row(r.id or "-", r.model_id, r.status, r.plan_id[:12], "\n".join(paths) or r.out_path,
                      (r.manifest_hash or "-")[:16])
        for attempt in view.attempts:
            table.add_row(r.id or "-", r.model_id, f"{attempt['status']} (re-run)", r.plan_id[:12],
                          attempt["path"], "-")
    plain_console().print(table)


def _pushed(hub: dict) -> str:
    """A Hub location (``HubPush.to_json``): its URI, when it was pushed and to which branch."""
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
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "json"]), default="text", show_default=True,
              help="text: a tree; dot: a Graphviz digraph (edges from parent to child); json: nested nodes, "
                   "with every stored score.")
def lineage_cmd(db_path: Path, model_id: str, fmt: str) -> None:
    """The tree of a model's parents (base and experts, with their versions), recursively; for a
    merged model also its earlier versions. Where models were evaluated, each shows its scores on the
    data evaluated for the most of them. MODEL_ID is a name (its latest version) or name@N."""
    root = views.lineage(db_path, model_id)
    pushed = root.get("hub_locations", [])
    if fmt == "json":
        click.echo(json.dumps(root, indent=2))
    elif fmt == "dot":
        copies = [f'  {json.dumps(root["label"])} -> {json.dumps(h["uri"])} [label="pushed"];' for h in pushed]
        echo("\n".join(["digraph lineage {", "  rankdir=BT;", *_dot_edges(root), *copies, "}"]))
    else:
        data = EvaluatedData(root["evaluated_on"]["data_digest"], root["evaluated_on"]["data_name"]) \
            if "evaluated_on" in root else None
        tree = Tree(Text.assemble((root["label"], "bold"), _scores(root, data), _searched(root)))
        _add_nodes(tree, root["parents"], data)
        plain_console().print(tree)
        if data is not None:
            echo(f"scores on {data.name} (data {data.digest[:DIGEST_CHARS]}): the data evaluated for the "
                 "most of these models; `--format json` has every score")
        for hub in pushed:
            echo(f"on the Hub: {_pushed(hub)}")


def _add_nodes(tree: Tree, nodes: list[dict], data: EvaluatedData | None) -> None:
    for node in nodes:
        branch = tree.add(Text.assemble(node["label"], (f" ({node['role']})", "dim"), _scores(node, data),
                                        _searched(node)))
        _add_nodes(branch, node["parents"], data)


def _scores(node: dict, data: EvaluatedData | None) -> str:
    """``  loss=2.5 perplexity=12.1825``: what the node's model scored on ``data``; empty if it was not."""
    if data is None:
        return ""
    text = compact([EvaluationRecord(**row) for row in node.get("evaluations", [])], data)
    return f"  {text}" if text else ""


def _searched(node: dict) -> str:
    """``  [best of search S: trial 7 of 40]`` for a snapshot a `mergepipe search` published."""
    return "".join(f"  [best of search {s['study']}: trial {s['trial']} of {s['trials']}]"
                   for s in node.get("searches", []))


def _dot_edges(node: dict) -> list[str]:
    """``"parent" -> "child" [label=role];`` for every edge under ``node``, each once."""
    edges: list[str] = []
    for parent in node["parents"]:
        edge = f'  {json.dumps(parent["label"])} -> {json.dumps(node["label"])} [label={json.dumps(parent["role"])}];'
        if edge not in edges:
            edges.append(edge)
        edges += [e for e in _dot_edges(parent) if e not in edges]
    return edges


COMMANDS = [models_cmd, show_cmd, snapshots_cmd, lineage_cmd]

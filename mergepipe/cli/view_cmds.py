"""Catalog views: models, show. Light: neither these commands nor what they import load torch."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from mergepipe.analysis.versions import changes
from mergepipe.catalog import Catalog
from mergepipe.cli.common import DB_OPTION, JSON_OPTION, echo_json, plain_console
from mergepipe.units import format_bytes


@click.command("models")
@DB_OPTION
@JSON_OPTION
def models(db_path: Path, as_json: bool) -> None:
    """List registered models with size, counts and analysis state."""
    with Catalog.open(db_path) as catalog:
        rows = [(m, catalog.model_status(m.id)) for m in catalog.models.list()]
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
        click.echo("no models registered yet (register one with `mergepipe register`)")
        return
    plain_console().print(table)


@click.command("show")
@DB_OPTION
@JSON_OPTION
@click.argument("model_id")
def show(db_path: Path, as_json: bool, model_id: str) -> None:
    """Show one model: files, tensors, parents and analyses."""
    with Catalog.open(db_path) as catalog:
        record = catalog.models.resolve(model_id)
        model_id = record.id
        status = catalog.model_status(model_id)
        files = catalog.models.files(model_id)
        tensors = catalog.models.tensors(model_id)
        blocks = catalog.blocks.by_tensor(model_id)
        parents = catalog.models.parents(model_id)
        analyses = catalog.stats.analyses(model_id)
        family = catalog.models.versions(record.name)
        history = [(v, None if i == 0 else changes(catalog, family[i - 1], v)) for i, v in enumerate(family)]
    if as_json:
        echo_json(
            {
                **record.to_json(),
                "status": status.to_json(),
                "files": [f.to_json() for f in files],
                "parents": [{"id": p, "role": r} for p, r in parents],
                "analyses": [a.to_json() for a in analyses],
                "tensors": [{**t.to_json(), "blocks": len(blocks.get(t.name, []))} for t in tensors],
                "versions": [{"id": v.id, "version": v.version, "created_at": v.created_at,
                              "changes": None if c is None else c.describe()} for v, c in history],
            }
        )
        return
    console = plain_console()
    against = f" against '{record.delta_base}'" if record.delta_base else ""  # a delta or a LoRA adapter
    console.print(Text.assemble((record.id, "bold"), f" ({record.kind}{against}, {record.label}) at {record.uri}"))
    console.print(
        f"architecture {record.architecture or '-'}, layers {record.num_layers if record.num_layers is not None else '-'}, "
        f"{format_bytes(record.total_bytes)} in {len(files)} file(s), {record.n_tensors} tensors, "
        f"{record.n_blocks} blocks; registered {record.created_at}"
    )
    console.print(f"fingerprint {record.fingerprint}")
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
            str(len(blocks.get(t.name, []))), t.file,
        )
    console.print(table)


COMMANDS = [models, show]

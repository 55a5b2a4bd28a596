"""Catalog commands: init-db, register, analyze, models, show.

Each command opens the catalog, makes one library call and prints the
result; errors are ``MergePipeError``s that ``mergepipe.cli.main`` prints
as one line.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.deltastore import build_store, has_store
from mergepipe.analysis.register import register as register_checkpoint
from mergepipe.analysis.versions import changes
from mergepipe.catalog import DEFAULT_BLOCK_BYTES, Catalog
from mergepipe.cli.common import DB_OPTION, JSON_OPTION, echo_json
from mergepipe.errors import ConfigError
from mergepipe.units import format_bytes, parse_size


@click.command("init-db")
@DB_OPTION
@click.option(
    "--block-bytes",
    default=None,
    help=f"Block size for every model of this catalog: bytes or a unit such as 512KiB "
    f"[default: {format_bytes(DEFAULT_BLOCK_BYTES)} for a new catalog, the existing size otherwise].",
)
def init_db(db_path: Path, block_bytes: str | None) -> None:
    """Create a catalog, or check an existing one (idempotent)."""
    size = None if block_bytes is None else parse_size(block_bytes, "--block-bytes")
    with Catalog.create(db_path, size, adopt_empty=True) as catalog:
        click.echo(
            f"catalog {db_path} ready: schema version {catalog.schema_version}, "
            f"blocks of {format_bytes(catalog.block_bytes)}"
        )


@click.command("register")
@DB_OPTION
@click.option("--model-id", required=True, help="Id to register the model under (e.g. llama3-8b-math).")
@click.option(
    "--uri",
    required=True,
    type=click.Path(path_type=Path),
    help="Checkpoint directory (model.safetensors or shards with an index).",
)
@click.option("--new-version", is_flag=True,
              help="The id is registered with other content: record this as its next version (id@N).")
@click.option("--force", is_flag=True,
              help="Replace the latest version of this id, dropping its statistics (refused for parents of snapshots).")
def register(db_path: Path, model_id: str, uri: Path, new_version: bool, force: bool) -> None:
    """Record a checkpoint's files, tensors and blocks (reads headers only)."""
    if new_version and force:
        raise ConfigError("--new-version and --force contradict each other: keep the old version, or replace it")
    with Catalog.open(db_path) as catalog:
        done = register_checkpoint(catalog, model_id, uri, force=force, new_version=new_version)
    record = done.record
    if done.status == "unchanged":
        click.echo(f"'{model_id}' is already registered from {record.uri} with the same files ({record.label}); "
                   "nothing to do")
        return
    arch = record.architecture or "unknown architecture"
    layers = f", {record.num_layers} layers" if record.num_layers is not None else ""
    what = {"registered": f"registered '{record.id}'", "replaced": f"replaced '{record.id}'",
            "new version": f"registered '{record.id}' (version {record.version} of '{record.name}')"}[done.status]
    click.echo(
        f"{what}: {record.n_tensors} tensors, {record.n_blocks} blocks, "
        f"{format_bytes(record.total_bytes)} ({arch}{layers})"
    )


@click.command("analyze")
@DB_OPTION
@click.option("--base", "base_id", default=None, help="Base model to compute expert deltas against.")
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar.")
@click.option(
    "--store-deltas",
    "store_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Also write each analysed expert's delta store (its delta entries, largest first) into this "
    "directory, for `plan --policy entries`. A store already built for the pair is kept.",
)
@click.argument("model_ids", nargs=-1)
def analyze_cmd(
    db_path: Path, base_id: str | None, no_progress: bool, store_dir: Path | None, model_ids: tuple[str, ...]
) -> None:
    """Hash blocks and compute expert-vs-base delta statistics, once.

    Without MODEL_IDS: every registered checkpoint against --base, or, with
    no --base, block hashes of every model. Work already recorded is skipped.
    """
    if store_dir is not None and base_id is None:
        raise ConfigError("--store-deltas needs --base: a delta store holds an expert's delta against one base")
    with Catalog.open(db_path) as catalog:
        report = analyze(catalog, list(model_ids) or None, base_id=base_id, progress=not no_progress)
        stores = []
        if store_dir is not None:
            for expert_id in (*report.analyzed, *report.skipped):
                if not has_store(catalog, expert_id, report.base_id):
                    stores.append(build_store(catalog, expert_id, report.base_id, store_dir, not no_progress))
    if report.analyzed:
        click.echo(f"analysed {', '.join(report.analyzed)} against '{report.base_id}'")
    for expert, (unchanged, total) in report.inherited.items():
        click.echo(f"  {expert}: analysed {total - unchanged} of {total} tensors ({unchanged} unchanged from its "
                   "previous version, whose statistics it inherits)")
    if report.skipped:
        click.echo(f"already analysed against '{report.base_id}': {', '.join(report.skipped)}")
    if report.hashed:
        click.echo(f"hashed blocks of {', '.join(report.hashed)}")
    if not (report.analyzed or report.hashed):
        click.echo("nothing to do")
    rate = f" ({report.bytes_per_second / 1e6:.0f} MB/s)" if report.bytes_read else ""
    click.echo(f"read {format_bytes(report.bytes_read)} in {report.seconds:.2f} s{rate}")
    for store in stores:
        click.echo(
            f"delta store of '{store.expert_id}': {store.entries} entries in {store.chunks} chunks, "
            f"{format_bytes(store.record.file_size)} at {store.record.path}, built in {store.seconds:.2f} s"
        )
    if store_dir is not None and not stores:
        click.echo("delta stores: every expert already has one")


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
    Console().print(table)


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
    console = Console()
    console.print(f"[bold]{record.id}[/] ({record.kind}, {record.label}) at {record.uri}")
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


COMMANDS = [init_db, register, analyze_cmd, models, show]

"""Catalog commands: init-db, register, analyze, models, show.

Each command opens the catalog, makes one library call and prints the
result; errors are ``MergePipeError``s that ``mergepipe.cli.main`` prints
as one line.
"""

from __future__ import annotations

from pathlib import Path

import click

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.deltastore import build_store, has_store
from mergepipe.analysis.register import register as register_checkpoint
from mergepipe.catalog import DEFAULT_BLOCK_BYTES, Catalog
from mergepipe.cli.common import DB_OPTION
from mergepipe.engine.probe import probe_kernels
from mergepipe.errors import ConfigError
from mergepipe.spec.operators import OPERATORS
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
    metavar="DIR|URI",
    help="Checkpoint directory (model.safetensors or shards with an index), or its s3://, http(s):// or "
    "file:// URI (remote: reads metadata and headers only; credentials from the environment).",
)
@click.option("--kind", type=click.Choice(["checkpoint", "delta", "lora"]), default="checkpoint", show_default=True,
              help="What the directory holds: full weights, a delta checkpoint (Δ = expert − base, named by its "
              "mergepipe_delta.json; `mergepipe export-delta` writes one), or a PEFT LoRA adapter (adapter_config.json "
              "+ adapter_model.safetensors; found without --kind when --base is given).")
@click.option("--base", "base_id", default=None,
              help="With --kind delta: the base the delta was taken against (its fingerprint must match; a base "
              "not analysed yet is read once to check it). With a LoRA adapter: the base it was trained on.")
@click.option("--new-version", is_flag=True,
              help="The id is registered with other content: record this as its next version (id@N).")
@click.option("--force", is_flag=True,
              help="Replace the latest version of this id, dropping its statistics (refused for parents of snapshots).")
def register(db_path: Path, model_id: str, uri: str, kind: str, base_id: str | None, new_version: bool,
             force: bool) -> None:
    """Record a checkpoint's files, tensors and blocks (reads headers only)."""
    if new_version and force:
        raise ConfigError("--new-version and --force contradict each other: keep the old version, or replace it")
    with Catalog.open(db_path) as catalog:
        done = register_checkpoint(catalog, model_id, uri, force=force, new_version=new_version, kind=kind,
                                   base=base_id)
    record = done.record
    if done.status == "unchanged":
        click.echo(f"'{model_id}' is already registered from {record.uri} with the same files ({record.label}); "
                   "nothing to do")
        return
    arch = record.architecture or "unknown architecture"
    layers = f", {record.num_layers} layers" if record.num_layers is not None else ""
    if record.kind in ("delta", "lora"):
        arch = f"a {'LoRA adapter' if record.kind == 'lora' else 'delta'} against '{record.delta_base}', {arch}"
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
    It also records the rate it read at and, once per machine, times each
    operator's kernel (milliseconds): plans then predict seconds, and a time
    budget works, with no other command.
    """
    if store_dir is not None and base_id is None:
        raise ConfigError("--store-deltas needs --base: a delta store holds an expert's delta against one base")
    with Catalog.open(db_path) as catalog:
        report = analyze(catalog, list(model_ids) or None, base_id=base_id, progress=not no_progress)
        probe_kernels(catalog, "cpu", OPERATORS)  # once per machine: what merging costs here, before any merge
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
        for path in store.swept:
            click.echo(f"removed {path}: left by a delta-store build that was killed")
        click.echo(
            f"delta store of '{store.expert_id}': {store.entries} entries in {store.chunks} chunks, "
            f"{format_bytes(store.record.file_size)} at {store.record.path}, built in {store.seconds:.2f} s"
        )
    if store_dir is not None and not stores:
        click.echo("delta stores: every expert already has one")


COMMANDS = [init_db, register, analyze_cmd]

"""Catalog commands: init-db, register, analyze, export-delta, gc, recover, rm and `catalog export`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mergepipe.analysis.register import SIDE_FILES_RECORDED
from mergepipe.app.analysing import DELTA_DTYPES, analyze, export_delta
from mergepipe.app.maintenance import Collected, export_catalog, gc, recover, remove
from mergepipe.app.registering import init_db, register
from mergepipe.catalog import DEFAULT_BLOCK_BYTES
from mergepipe.catalog.database import Location
from mergepipe.cli.common import CATALOG, DB_OPTION, NO_PROGRESS_OPTION, ConsoleReporter, echo
from mergepipe.sizes import format_bytes


@click.command("init-db")
@DB_OPTION
@click.option(
    "--block-bytes",
    default=None,
    help=f"Block size for every model of this catalog: bytes or a unit such as 512KiB "
    f"[default: {format_bytes(DEFAULT_BLOCK_BYTES)} for a new catalog, the existing size otherwise].",
)
def init_db_cmd(db_path: Path, block_bytes: str | None) -> None:
    """Create a catalog, or check an existing one (idempotent)."""
    catalog = init_db(db_path, block_bytes)
    echo(
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
    "file:// URI, or a Hugging Face Hub model hf://ORG/NAME[@REVISION] or ORG/NAME[@REVISION] as mergekit "
    "writes it (a local folder of that name wins; recorded at the commit the revision names now). Remote: reads "
    "metadata and headers only; credentials from the environment (HF_TOKEN or the stored login for the Hub).",
)
@click.option(
    "--kind",
    type=click.Choice(["checkpoint", "delta", "lora"]),
    default="checkpoint",
    show_default=True,
    help="What the directory holds: full weights, a delta checkpoint (Δ = expert − base, named by its "
    "mergepipe_delta.json; `mergepipe export-delta` writes one), or a PEFT LoRA adapter (adapter_config.json "
    "+ adapter_model.safetensors; found without --kind when --base is given).",
)
@click.option(
    "--base",
    default=None,
    help="With --kind delta: the base the delta was taken against (its fingerprint must match; a base "
    "not analysed yet is read once to check it). With a LoRA adapter: the base it was trained on.",
)
@click.option(
    "--new-version",
    is_flag=True,
    help="The id is registered with other content: record this as its next version (id@N).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace the latest version of this id, dropping its statistics (refused for parents of snapshots).",
)
def register_cmd(db_path: Path, model_id: str, uri: str, **options: Any) -> None:
    """Record a checkpoint's files, tensors and blocks (reads headers and side files only)."""
    done = register(db_path, model_id, uri, **options, reporter=ConsoleReporter())
    record = done.record
    if done.status == "unchanged":
        echo(
            f"'{model_id}' is already registered from {record.uri} with the same files ({record.label}); nothing to do"
        )
        return
    if done.status == SIDE_FILES_RECORDED:
        echo(
            f"'{model_id}' is already registered from {record.uri} with the same weight files "
            f"({record.label}), by an earlier MergePipe that left its side files out (config, tokenizer: merges "
            "copy them); they are recorded now, no new version: merges of it plan anew once, their plans "
            "naming them"
        )
        return
    arch = record.architecture or "unknown architecture"
    layers = f", {record.num_layers} layers" if record.num_layers is not None else ""
    if record.kind in ("delta", "lora"):
        arch = f"a {'LoRA adapter' if record.kind == 'lora' else 'delta'} against '{record.delta_base}', {arch}"
    what = {
        "registered": f"registered '{record.id}'",
        "replaced": f"replaced '{record.id}'",
        "new version": f"registered '{record.id}' (version {record.version} of '{record.name}')",
    }[done.status]
    echo(
        f"{what}: {record.n_tensors} tensors, {record.n_blocks} blocks, "
        f"{format_bytes(record.total_bytes)} ({arch}{layers})"
    )
    if record.uri != uri and record.uri.startswith("hf://"):  # a Hub revision, pinned
        echo(f"  from {record.uri} (the commit {uri} names now)")


@click.command("analyze")
@DB_OPTION
@click.option("--base", default=None, help="Base model to compute expert deltas against.")
@NO_PROGRESS_OPTION
@click.option(
    "--store-deltas",
    "store_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Also write each analysed expert's delta store (its delta entries, largest first) into this "
    "directory, for `plan --policy entries`. A store already built for the pair is kept.",
)
@click.argument("model_ids", nargs=-1)
def analyze_cmd(db_path: Path, model_ids: tuple[str, ...], no_progress: bool, **options: Any) -> None:
    """Hash blocks and compute expert-vs-base delta statistics, once.

    Without MODEL_IDS: every registered checkpoint against --base, or, with
    no --base, block hashes of every model. Work already recorded is skipped.
    """
    done = analyze(db_path, list(model_ids), **options, progress=not no_progress, reporter=ConsoleReporter())
    report, stores = done.report, done.stores
    if report.analyzed:
        echo(f"analysed {', '.join(report.analyzed)} against '{report.base_id}'")
    for expert, (unchanged, total) in report.inherited.items():
        echo(
            f"  {expert}: analysed {total - unchanged} of {total} tensors ({unchanged} unchanged from its "
            "previous version, whose statistics it inherits)"
        )
    if report.skipped:
        echo(f"already analysed against '{report.base_id}': {', '.join(report.skipped)}")
    if report.hashed:
        echo(f"hashed blocks of {', '.join(report.hashed)}")
    if report.analyzed or report.hashed:
        rate = f" ({report.bytes_per_second / 1e6:.0f} MB/s)" if report.bytes_read else ""
        echo(f"read {format_bytes(report.bytes_read)} in {report.seconds:.2f} s{rate}")
    elif stores:
        echo(
            "statistics already recorded: only the delta stores were built (each reads its expert and the base in full)"
        )
    else:
        echo("nothing to do (read 0 B)")
    for store in stores:
        for path in store.swept:
            echo(f"removed {path}: left by a delta-store build that was killed")
        echo(
            f"delta store of '{store.expert_id}': {store.entries} entries in {store.chunks} chunks, "
            f"{format_bytes(store.record.file_size)} at {store.record.path}, built in {store.seconds:.2f} s"
        )
    if options["store_dir"] is not None and not stores:
        echo("delta stores: every expert already has one")


@click.command("export-delta")
@DB_OPTION
@click.option("--model", "model_id", required=True, help="The expert to export (a registered checkpoint).")
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory to create (refused if it exists); written beside it, then renamed into place.",
)
@click.option(
    "--base",
    default=None,
    help="The base to take the delta against [default: the one base the expert is analysed against].",
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(DELTA_DTYPES)),
    default="f32",
    show_default=True,
    help="dtype of the delta's tensors; f32 carries exactly the Δ a merge computes.",
)
@click.option(
    "--density",
    type=float,
    default=None,
    help="Keep each tensor's top fraction of entries by |Δ| (ties by position), zeros elsewhere.",
)
@NO_PROGRESS_OPTION
def export_delta_cmd(db_path: Path, model_id: str, out: Path, no_progress: bool, **options: Any) -> None:
    """Write an expert as a delta checkpoint (Δ = expert − base), for `register --kind delta`."""
    report = export_delta(db_path, model_id, out, **options, progress=not no_progress, reporter=ConsoleReporter())
    if report.analysed:
        echo(f"analysed {report.expert_id} against '{report.base_id}' first")
    trimmed = f", top {report.density:g} of each tensor" if report.density is not None else ""
    echo(
        f"wrote the delta of '{report.expert_id}' against '{report.base_id}' to {out}: {report.tensors} "
        f"tensors ({report.dtype}{trimmed}) in {sum(f.endswith('.safetensors') for f in report.files)} "
        "weight file(s)"
    )

    def share(n: int) -> str:
        return f"{100 * report.total_bytes / n:.1f}%" if n else "-"

    echo(
        f"size {format_bytes(report.total_bytes)}: {share(report.expert_bytes)} of the full checkpoint "
        f"({format_bytes(report.expert_bytes)}), {share(report.base_bytes)} of the base "
        f"({format_bytes(report.base_bytes)})"
    )
    if report.unmerged_changes:
        echo(f"left out (never merged, the base's value is kept): {', '.join(report.unmerged_changes)}")
    echo(f"register it with: mergepipe register --kind delta --base {report.base_id} --uri {out} --model-id ID")


@click.group("catalog")
def catalog_group() -> None:
    """Operations on a whole catalog: export copies it to another file or PostgreSQL database."""


@catalog_group.command("export")
@DB_OPTION
@click.option(
    "--to",
    "target",
    required=True,
    type=CATALOG,
    help="The catalog to copy into: a new file, or an empty PostgreSQL database "
    "(postgresql://USER@HOST:PORT/DBNAME) that gets the schema.",
)
def export_cmd(db_path: Location, target: Location) -> None:
    """Copy every record of a catalog (models, analyses, plans, snapshots, timings, evaluations) and its search
    studies into a new one, SQLite or PostgreSQL, so that nothing is registered or analysed again."""
    done = export_catalog(db_path, target, reporter=ConsoleReporter())
    tables = sum(1 for n in done.rows.values() if n)
    echo(
        f"exported {done.source} to {done.target}: {done.total} rows in {tables} tables "
        f"({done.rows['models']} models, {done.rows['plans']} plans, {done.rows['snapshots']} snapshots)"
        + (f" and {len(done.studies)} search studies" if done.studies else "")
    )


@click.command("gc")
@DB_OPTION
@click.option(
    "--versions",
    "old_versions",
    is_flag=True,
    help="Also list expert versions (checkpoints, deltas, LoRA adapters) that are not the latest of "
    "their id and that no snapshot used "
    "(a dry run; add --yes to drop them from the catalog, with their delta-store files).",
)
@click.option("--yes", is_flag=True, help="With --versions: drop the versions listed.")
@click.option(
    "--plans",
    "saved_plans",
    is_flag=True,
    help="Also delete plans saved with `plan --save` that no merge ran (kept by default).",
)
def gc_cmd(db_path: Path, old_versions: bool, yes: bool, saved_plans: bool) -> None:
    """Remove aborted staging directories and killed delta-store builds' staging files (never a committed
    snapshot, a saved plan or a user file)."""
    done = gc(db_path, versions=old_versions, drop=yes, plans=saved_plans)
    if old_versions:
        _print_versions(done, yes)
    n, dirs = done.saved_plans, len(done.removed_dirs)
    plans = f"; deleted {n} saved plan(s) no merge ran" if done.plans_deleted else ""
    plans = f"; kept {n} saved plan(s) no merge ran (--plans deletes them)" if n and not plans else plans
    echo(f"gc: removed {dirs} staging director{'y' if dirs == 1 else 'ies'}{plans}")
    for path in done.swept:
        echo(f"gc: removed {path}: left by a delta-store build that was killed")
    for problem in done.problems:
        echo(f"  {problem}", err=True)


def _print_versions(done: Collected, act: bool) -> None:
    if not done.old_versions:
        echo("gc: no old versions to drop (every older version is a parent of a snapshot, or there are none)")
        return
    for record in done.old_versions:
        echo(f"  {record.label} ({record.id}, registered {record.created_at}, {record.uri})")
    if not act:
        echo(
            f"gc: {len(done.old_versions)} old version(s) no snapshot uses; run again with --yes to drop "
            "them from the catalog (the checkpoint directories stay)"
        )
        return
    echo(
        f"gc: dropped {len(done.dropped)} old version(s) from the catalog, and {len(done.store_files)} "
        "delta-store file(s)"
    )
    for record in done.old_versions:
        if record not in done.dropped:
            echo(f"gc: kept {record.label}: a merge that reads it started meanwhile")


@click.command("recover")
@DB_OPTION
def recover_cmd(db_path: Path) -> None:
    """Finish or roll back interrupted publishes (idempotent)."""
    report = recover(db_path)
    echo(f"recover: {report.summary()}")
    for problem in report.problems:
        echo(f"  {problem}", err=True)


@click.command("rm")
@DB_OPTION
@click.argument("target")
def rm_cmd(db_path: Path, target: str) -> None:
    """Delete a snapshot's directory; the catalog keeps the snapshot, so executing its plan re-materialises it.

    TARGET is a snapshot's directory; a snapshot id (or unique prefix), whose every directory is removed; or
    a merged model id (name@N for a version), whose directories are removed (those publishing the same
    snapshot under another id stay). Only what MergePipe wrote is deleted (the files the manifest
    lists, the model card, config file and manifest); anything else found there stays, with its folder. A
    directory that is not a snapshot of this catalog is refused.
    """
    done = remove(db_path, target)
    what = f"snapshot {done.snapshot_id} ('{done.model}')"
    if not done.locations:
        echo(f"rm: {what} has no directory left to remove; nothing to do")
    for location in done.locations:
        if not location.was_there:
            echo(f"rm: {location.path} ({what}) was gone already; recorded as removed")
        elif location.kept:
            shown = ", ".join(location.kept[:3]) + (
                f" and {len(location.kept) - 3} more" if len(location.kept) > 3 else ""
            )
            echo(
                f"rm: removed {what}'s files from {location.path}; kept the folder, which holds "
                f"{len(location.kept)} file(s) MergePipe did not write: {shown}"
            )
        else:
            echo(f"rm: removed {location.path} ({what})")
    if done.remaining:
        echo(f"rm: {what} is still at {', '.join(done.remaining)}")
    else:
        echo(f"rm: the catalog keeps {what} and its lineage; {done.advice}")


COMMANDS = [init_db_cmd, register_cmd, analyze_cmd, export_delta_cmd, catalog_group, gc_cmd, recover_cmd, rm_cmd]

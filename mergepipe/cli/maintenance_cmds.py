"""Maintenance: gc (staging leftovers, unreferenced plans, old versions) and recover."""

from __future__ import annotations

import os
from pathlib import Path

import click

from mergepipe.analysis.deltastore import sweep_abandoned
from mergepipe.analysis.versions import drop, droppable
from mergepipe.catalog import Catalog
from mergepipe.cli.common import DB_OPTION as _DB
from mergepipe.errors import ConfigError
from mergepipe.txn.recover import recover
from mergepipe.txn.staging import remove_staging


@click.command("gc")
@_DB
@click.option("--versions", "old_versions", is_flag=True,
              help="Also list expert versions (checkpoints, deltas, LoRA adapters) that are not the latest of "
              "their id and that no snapshot used "
              "(a dry run; add --yes to drop them from the catalog, with their delta-store files).")
@click.option("--yes", is_flag=True, help="With --versions: drop the versions listed.")
@click.option("--plans", "saved_plans", is_flag=True,
              help="Also delete plans saved with `plan --save` that no merge ran (kept by default).")
def gc_cmd(db_path: Path, old_versions: bool, yes: bool, saved_plans: bool) -> None:
    """Remove aborted staging directories and killed delta-store builds' staging files (never a committed
    snapshot, a saved plan or a user file)."""
    if yes and not old_versions:
        raise ConfigError("--yes only confirms --versions; nothing else gc does needs confirming")
    with Catalog.open(db_path) as catalog:
        report = recover(catalog)  # first: a merge that died no longer holds its inputs
        if old_versions:
            _gc_versions(catalog, yes)
        removed_dirs, problems = list(report.removed), list(report.problems)
        for record in catalog.snapshots.list():
            staging = Path(record.staging_path)
            if record.status != "aborted" or not os.path.lexists(staging):
                continue
            problem = remove_staging(staging, record.intent_id, Path(record.out_path))
            if problem is None:
                removed_dirs.append(staging)
            else:
                problems.append(problem)
        unused = catalog.plans.delete_unreferenced() if saved_plans else catalog.plans.count_unreferenced()
        store_dirs = sorted({Path(path).parent for path in catalog.deltas.paths()})
    plans = (f"deleted {unused} saved plan(s) no merge ran" if saved_plans else
             f"kept {unused} saved plan(s) no merge ran (--plans deletes them)" if unused else "")
    click.echo(f"gc: removed {len(removed_dirs)} staging director{'y' if len(removed_dirs) == 1 else 'ies'}"
               + (f"; {plans}" if plans else ""))
    for directory in store_dirs:  # where this catalog's delta stores live: a killed build's staging files
        for path in sweep_abandoned(directory) if directory.is_dir() else ():
            click.echo(f"gc: removed {path}: left by a delta-store build that was killed")
    for problem in problems:
        click.echo(f"  {problem}", err=True)


def _gc_versions(catalog: Catalog, act: bool) -> None:
    old = droppable(catalog)
    if not old:
        click.echo("gc: no old versions to drop (every older version is a parent of a snapshot, or there are none)")
        return
    for record in old:
        click.echo(f"  {record.label} ({record.id}, registered {record.created_at}, {record.uri})")
    if not act:
        click.echo(f"gc: {len(old)} old version(s) no snapshot uses; run again with --yes to drop them from the "
                   "catalog (the checkpoint directories stay)")
        return
    dropped, files = drop(catalog, old)
    click.echo(f"gc: dropped {len(dropped)} old version(s) from the catalog, and {len(files)} delta-store file(s)")
    for record in old:
        if record not in dropped:
            click.echo(f"gc: kept {record.label}: a merge that reads it started meanwhile")


@click.command("recover")
@_DB
def recover_cmd(db_path: Path) -> None:
    """Finish or roll back interrupted publishes (idempotent)."""
    with Catalog.open(db_path) as catalog:
        report = recover(catalog)
    click.echo(f"recover: committed {len(report.committed)}, aborted {len(report.aborted)}, "
               f"removed {len(report.removed)} staging director{'y' if len(report.removed) == 1 else 'ies'}"
               + (f", {len(report.busy)} in progress elsewhere" if report.busy else ""))
    for problem in report.problems:
        click.echo(f"  {problem}", err=True)


COMMANDS = [gc_cmd, recover_cmd]

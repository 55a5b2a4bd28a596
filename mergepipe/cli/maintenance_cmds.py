"""Maintenance: gc (staging leftovers, unreferenced plans, old versions) and recover (``app/maintenance.py``)."""

from __future__ import annotations

from pathlib import Path

import click

from mergepipe.app.maintenance import Collected, gc, recover
from mergepipe.cli.common import DB_OPTION as _DB


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
    done = gc(db_path, versions=old_versions, drop=yes, plans=saved_plans)
    if old_versions:
        _print_versions(done, yes)
    n = done.saved_plans
    plans = (f"deleted {n} saved plan(s) no merge ran" if done.plans_deleted else
             f"kept {n} saved plan(s) no merge ran (--plans deletes them)" if n else "")
    dirs = len(done.removed_dirs)
    click.echo(f"gc: removed {dirs} staging director{'y' if dirs == 1 else 'ies'}" + (f"; {plans}" if plans else ""))
    for path in done.swept:
        click.echo(f"gc: removed {path}: left by a delta-store build that was killed")
    for problem in done.problems:
        click.echo(f"  {problem}", err=True)


def _print_versions(done: Collected, act: bool) -> None:
    if not done.old_versions:
        click.echo("gc: no old versions to drop (every older version is a parent of a snapshot, or there are none)")
        return
    for record in done.old_versions:
        click.echo(f"  {record.label} ({record.id}, registered {record.created_at}, {record.uri})")
    if not act:
        click.echo(f"gc: {len(done.old_versions)} old version(s) no snapshot uses; run again with --yes to drop "
                   "them from the catalog (the checkpoint directories stay)")
        return
    click.echo(f"gc: dropped {len(done.dropped)} old version(s) from the catalog, and {len(done.store_files)} "
               "delta-store file(s)")
    for record in done.old_versions:
        if record not in done.dropped:
            click.echo(f"gc: kept {record.label}: a merge that reads it started meanwhile")


@click.command("recover")
@_DB
def recover_cmd(db_path: Path) -> None:
    """Finish or roll back interrupted publishes (idempotent)."""
    report = recover(db_path)
    click.echo(f"recover: committed {len(report.committed)}, aborted {len(report.aborted)}, "
               f"removed {len(report.removed)} staging director{'y' if len(report.removed) == 1 else 'ies'}"
               + (f", {len(report.busy)} in progress elsewhere" if report.busy else ""))
    for problem in report.problems:
        click.echo(f"  {problem}", err=True)


COMMANDS = [gc_cmd, recover_cmd]

"""Maintenance: gc (staging leftovers, unreferenced plans, old versions), recover, and rm (a snapshot's
directory) (``app/maintenance.py``)."""

from __future__ import annotations

from pathlib import Path

import click

from mergepipe.app.maintenance import Collected, gc, recover, remove
from mergepipe.cli.common import DB_OPTION as _DB, echo


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
    echo(f"gc: removed {dirs} staging director{'y' if dirs == 1 else 'ies'}" + (f"; {plans}" if plans else ""))
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
        echo(f"gc: {len(done.old_versions)} old version(s) no snapshot uses; run again with --yes to drop "
             "them from the catalog (the checkpoint directories stay)")
        return
    echo(f"gc: dropped {len(done.dropped)} old version(s) from the catalog, and {len(done.store_files)} "
         "delta-store file(s)")
    for record in done.old_versions:
        if record not in done.dropped:
            echo(f"gc: kept {record.label}: a merge that reads it started meanwhile")


@click.command("recover")
@_DB
def recover_cmd(db_path: Path) -> None:
    """Finish or roll back interrupted publishes (idempotent)."""
    report = recover(db_path)
    echo(f"recover: committed {len(report.committed)}, aborted {len(report.aborted)}, "
         f"removed {len(report.removed)} staging director{'y' if len(report.removed) == 1 else 'ies'}"
         + (f", {len(report.busy)} in progress elsewhere" if report.busy else ""))
    for problem in report.problems:
        echo(f"  {problem}", err=True)


@click.command("rm")
@_DB
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
            shown = ", ".join(location.kept[:3]) + (f" and {len(location.kept) - 3} more" if len(location.kept) > 3
                                                     else "")
            echo(f"rm: removed {what}'s files from {location.path}; kept the folder, which holds "
                 f"{len(location.kept)} file(s) MergePipe did not write: {shown}")
        else:
            echo(f"rm: removed {location.path} ({what})")
    if done.remaining:
        echo(f"rm: {what} is still at {', '.join(done.remaining)}")
    else:
        echo(f"rm: the catalog keeps {what} and its lineage; {done.advice}")


COMMANDS = [gc_cmd, recover_cmd, rm_cmd]

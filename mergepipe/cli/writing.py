"""Opening the catalog for a command that writes: recover interrupted publishes first."""

from __future__ import annotations

import os
from pathlib import Path

import click

from mergepipe.catalog import Catalog
from mergepipe.txn.recover import recover


def open_for_writing(db_path: Path, out: Path | None = None, block_bytes: int | None = None) -> Catalog:
    """Open (or create, with ``block_bytes`` if given) the catalog and finish any interrupted publish
    first (also looking beside ``out`` for a publish killed before its intent)."""
    catalog = Catalog.create(db_path, block_bytes)  # opens an existing catalog; safe when two processes race
    report = recover(catalog, also_scan=[] if out is None else [Path(os.path.abspath(out)).parent])
    if report.changed:
        click.echo(f"recovered: committed {len(report.committed)}, aborted {len(report.aborted)}, "
                   f"removed {len(report.removed)} staging director{'y' if len(report.removed) == 1 else 'ies'}",
                   err=True)
    return catalog

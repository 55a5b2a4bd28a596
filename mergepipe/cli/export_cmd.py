"""export-delta: write an expert as a delta checkpoint (``analysis/export_delta.py``), published atomically."""

from __future__ import annotations

from pathlib import Path

import click

from mergepipe.analysis.export_delta import ExportReport, export_delta
from mergepipe.catalog import Catalog
from mergepipe.cli.common import DB_OPTION
from mergepipe.errors import ConfigError, PublishError
from mergepipe.txn.outpath import refuse_inside_models
from mergepipe.txn.publish import TransactionManager, refuse_existing
from mergepipe.units import format_bytes

_DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


@click.command("export-delta")
@DB_OPTION
@click.option("--model", "model_id", required=True, help="The expert to export (a registered checkpoint).")
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path),
              help="Directory to create (refused if it exists); written beside it, then renamed into place.")
@click.option("--base", "base_id", default=None,
              help="The base to take the delta against [default: the one base the expert is analysed against].")
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="f32", show_default=True,
              help="dtype of the delta's tensors; f32 carries exactly the Δ a merge computes.")
@click.option("--density", type=float, default=None,
              help="Keep each tensor's top fraction of entries by |Δ| (ties by position), zeros elsewhere.")
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar.")
def export_delta_cmd(db_path: Path, model_id: str, out_path: Path, base_id: str | None, dtype: str,
                     density: float | None, no_progress: bool) -> None:
    """Write an expert as a delta checkpoint (Δ = expert − base), for `register --kind delta`."""
    if density is not None and not 0.0 < density <= 1.0:
        raise ConfigError(f"--density must be in (0, 1], got {density}")
    txn = TransactionManager()
    with Catalog.open(db_path) as catalog:
        refuse_inside_models(catalog, refuse_existing(out_path))
        with txn.staged(out_path) as area:
            try:
                report = export_delta(catalog, model_id, area.path, base=base_id, dtype=_DTYPES[dtype],
                                      density=density, progress=not no_progress)
            except OSError as exc:  # disk full, permissions: the staging area is removed on the way out
                raise PublishError(f"cannot write the delta checkpoint {area.out_path}: {exc.strerror or exc}; "
                                   "nothing was written. Free space or fix the permissions (or choose another "
                                   "--out) and retry") from None
            txn.publish(area)
    _print(report, area.out_path)


def _print(report: ExportReport, out: Path) -> None:
    if report.analysed:
        click.echo(f"analysed {report.expert_id} against '{report.base_id}' first")
    trimmed = f", top {report.density:g} of each tensor" if report.density is not None else ""
    click.echo(f"wrote the delta of '{report.expert_id}' against '{report.base_id}' to {out}: {report.tensors} "
               f"tensors ({report.dtype}{trimmed}) in {sum(f.endswith('.safetensors') for f in report.files)} "
               "weight file(s)")
    def share(n: int) -> str:
        return f"{100 * report.total_bytes / n:.1f}%" if n else "-"
    click.echo(f"size {format_bytes(report.total_bytes)}: {share(report.expert_bytes)} of the full checkpoint "
               f"({format_bytes(report.expert_bytes)}), {share(report.base_bytes)} of the base "
               f"({format_bytes(report.base_bytes)})")
    if report.unmerged_changes:
        click.echo(f"left out (never merged, the base's value is kept): {', '.join(report.unmerged_changes)}")
    click.echo(f"register it with: mergepipe register --kind delta --base {report.base_id} --uri {out} "
               f"--model-id ID")


COMMANDS = [export_delta_cmd]

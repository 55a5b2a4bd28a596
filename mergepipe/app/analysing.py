"""`analyze` and `export-delta`: the calls that read checkpoints in full (and load torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.analysis.analyze import AnalyzeReport
from mergepipe.analysis.analyze import analyze as analyze_models
from mergepipe.analysis.deltastore import StoreReport, build_store, has_store
from mergepipe.analysis.export_delta import ExportReport
from mergepipe.analysis.export_delta import export_delta as write_delta
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.engine.probe import probe_kernels
from mergepipe.errors import ConfigError, PublishError
from mergepipe.spec.operators import OPERATORS
from mergepipe.txn.outpath import refuse_inside_models
from mergepipe.txn.publish import TransactionManager, refuse_existing, resolve_output

#: ``--dtype`` of export-delta -> the safetensors dtype written.
DELTA_DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


@dataclass(frozen=True)
class Analysis:
    """What ``analyze`` did, and the delta stores it built."""

    report: AnalyzeReport
    stores: list[StoreReport] = field(default_factory=list)


def analyze(
    db: Catalogish,
    models: list[str] | None = None,
    *,
    base: str | None = None,
    store_dir: str | Path | None = None,
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> Analysis:
    """Analyse ``models`` against ``base`` (or hash their blocks); ``store_dir``: also build delta stores there."""
    if store_dir is not None and base is None:
        raise ConfigError("--store-deltas needs --base: a delta store holds an expert's delta against one base")
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        if store_dir is not None:
            refuse_inside_models(catalog, resolve_output(store_dir), option="--store-deltas")
        report = analyze_experts(catalog, models or None, base, progress)
        stores, base_id = [], report.base_id
        if store_dir is not None and base_id is not None:
            for expert_id in (*report.analyzed, *report.skipped):
                if not has_store(catalog, expert_id, base_id):
                    stores.append(build_store(catalog, expert_id, base_id, Path(store_dir), progress))
    return Analysis(report, stores)


def analyze_experts(catalog: Catalog, models: list[str] | None, base: str | None, progress: bool) -> AnalyzeReport:
    """Analyse ``models`` against ``base`` in an open catalog, then time each operator's kernel once."""
    report = analyze_models(catalog, models, base_id=base, progress=progress)
    if report.analyzed or report.hashed:
        catalog.refresh_statistics()
    probe_kernels(catalog, "cpu", OPERATORS)
    return report


def export_delta(
    db: Catalogish,
    model_id: str,
    out: str | Path,
    *,
    base: str | None = None,
    dtype: str = "f32",
    density: float | None = None,
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> ExportReport:
    """Write expert ``model_id`` as a delta checkpoint at ``out``; ``density`` keeps the top entries by abs(Δ)."""
    if density is not None and not 0.0 < density <= 1.0:
        raise ConfigError(f"--density must be in (0, 1], got {density}")
    if dtype not in DELTA_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DELTA_DTYPES)}, got {dtype!r}")
    txn = TransactionManager()
    with open_catalog(db, writing=True, out=out, reporter=reporter) as catalog:
        refuse_inside_models(catalog, refuse_existing(out))
        with txn.staged(out) as area:
            try:
                report = write_delta(
                    catalog,
                    model_id,
                    area.path,
                    base=base,
                    dtype=DELTA_DTYPES[dtype],
                    density=density,
                    progress=progress,
                )
            except OSError as exc:  # disk full, permissions: the staging area is removed on the way out
                raise PublishError(
                    f"cannot write the delta checkpoint {area.out_path}: {exc.strerror or exc}; "
                    "nothing was written. Free space or fix the permissions (or choose another "
                    "--out) and retry"
                ) from None
            txn.publish(area)
    return report

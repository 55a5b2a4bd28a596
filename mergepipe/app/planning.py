"""`plan`: a merge request planned against the catalog, reading no expert byte (what is missing analysed first
when asked)."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from mergepipe.app.registering import resolved
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.planner.planner import Planner, check_copies
from mergepipe.spec.mergekit import ConfigFile, load_config
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest


def plan(
    request: MergeRequest,
    db: Catalogish,
    *,
    save: bool = False,
    analyze_missing: bool = True,
    strict: bool = False,
    device: str = "cpu",
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> Plan:
    """Plan ``request`` in catalog ``db``; ``save`` stores it; ``analyze_missing=False`` refuses unanalysed experts."""
    with open_catalog(db, writing=True, block_bytes=request.block_bytes, reporter=reporter) as catalog:
        made = make_plan(
            catalog,
            request,
            analyze_missing=analyze_missing,
            strict=strict,
            device=device,
            progress=progress,
            reporter=reporter,
        )
        if save:
            catalog.plans.save(made.digest, made.to_json_str())
    return made


def read_config(path: str | Path) -> ConfigFile:
    """The merge config file at ``path`` (MergePipe's own form or a mergekit YAML), parsed."""
    path = Path(path)
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc.strerror})") from None
    return load_config(content, str(path))


def make_plan(
    catalog: Catalog,
    request: MergeRequest,
    *,
    analyze_missing: bool = True,
    strict: bool = False,
    device: str = "cpu",
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> Plan:
    """The plan of ``request`` in an open catalog, its missing analyses done first."""
    with resolved(catalog, request) as exact:
        if exact.slices is not None:
            check_copies(catalog, exact)
        if analyze_missing:
            _analyze_missing(catalog, exact, progress, reporter)
        made = Planner(catalog, device).plan(exact)
    for note in request.notes:  # once the plan exists: a refusal stays one line
        reporter.note(f"note: {note}")
    cost = made.cost
    if cost.expert_bytes == 0 and made.copies is None:  # what the plan's table would bury
        why = (
            f"the budget ({made.budget_text}) is below the cheapest useful read"
            if cost.full_expert_bytes
            else "every expert block is identical to the base"
        )
        message = (
            f"{why}: the plan reads nothing from the experts and the output equals the base (Σw·B where the "
            "weights are not normalised)"
        )
        if strict:
            raise BudgetError(f"{message} (--strict); raise --budget, or check the experts")
        reporter.warning(f"warning: {message}")
    for note in made.notes:
        if note.startswith("warning: "):
            reporter.warning(note)
    return made


def _analyze_missing(catalog: Catalog, request: MergeRequest, progress: bool, reporter: Reporter) -> None:
    """Analyse the experts not yet analysed (a passthrough: hash its sources); torch loads only then."""
    models = catalog.models
    if request.slices is not None:
        records = [models.resolve(m) for m in dict.fromkeys([request.base, *request.experts])]
        missing = [models.exact_ref(r) for r in records if catalog.blocks.hashed_count(r.id) < r.n_blocks]
        base: str | None = None
    else:
        base_id = models.resolve(request.base).id
        missing = [e for e in request.experts if not catalog.stats.is_analyzed(models.resolve(e).id, base_id)]
        base = request.base
    if missing:
        report = import_module("mergepipe.app.analysing").analyze_experts(catalog, missing, base, progress)
        verb, against = ("hashed", "") if base is None else ("analysed", f" against '{base}'")
        reporter.note(f"{verb} {', '.join(missing)}{against} in {report.seconds:.1f} s (once: later plans reuse it)")

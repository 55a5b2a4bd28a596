"""`plan`: a merge request planned against the catalog, without reading any expert byte.

The models the request names are resolved (directories registered on the
fly, taken back if planning fails), experts not yet analysed against the
base are analysed first (by default, as ``merge`` does; that does read
them, once, and loads torch: only then is the analysis module imported),
and the planner makes the plan. What the plan would bury is said through the reporter: that its
output equals the base (an error with ``strict``), and its warnings.

A passthrough (``slices:``) compares nothing with the base: its copy map and budget are checked from
the catalog's records first, then the sources whose blocks are not hashed yet are hashed (the engine
checks every block it copies), and the planner makes its copy plan.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from mergepipe.app.registering import resolved
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.planner.planner import check_copies
from mergepipe.planner.planner import Planner
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
    """Plan ``request`` in catalog ``db`` (created if missing; None: the default catalog); ``save`` stores
    the plan for `execute`; ``analyze_missing=False`` refuses experts not analysed yet instead."""
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
    analyze_missing: bool,
    strict: bool,
    device: str,
    progress: bool,
    reporter: Reporter,
) -> Plan:
    """The plan of ``request`` in an open catalog (see the module docstring)."""
    with resolved(catalog, request) as exact:
        if exact.slices is not None:
            check_copies(catalog, exact)  # a map or budget that cannot be is refused before any read
            if analyze_missing:
                _hash_missing(catalog, [exact.base, *exact.experts], progress, reporter)
        elif analyze_missing:
            _analyze_missing(catalog, exact.base, list(exact.experts), progress, reporter)
        made = Planner(catalog, device).plan(exact)
    for note in request.notes:  # once the plan exists: a refusal stays one line
        reporter.note(f"note: {note}")
    _warn_about(made, strict, reporter)
    return made


def _analyze_missing(catalog: Catalog, base: str, experts: list[str], progress: bool, reporter: Reporter) -> None:
    """Analyse the experts not yet analysed against ``base``. Finding them is a catalog query; only
    analysing imports the analysis module (and torch)."""
    base_id = catalog.models.resolve(base).id
    missing = [e for e in experts if e != base and not catalog.stats.is_analyzed(catalog.models.resolve(e).id, base_id)]
    if missing:
        report = import_module("mergepipe.app.analysing").analyze_experts(catalog, missing, base, progress)
        reporter.note(
            f"analysed {', '.join(missing)} against '{base}' in {report.seconds:.1f} s (once: later plans reuse it)"
        )


def _hash_missing(catalog: Catalog, models: list[str], progress: bool, reporter: Reporter) -> None:
    """Hash the blocks of the models not hashed in full yet (a passthrough's sources and base)."""
    records = [catalog.models.resolve(m) for m in dict.fromkeys(models)]
    missing = [catalog.models.exact_ref(r) for r in records if catalog.blocks.hashed_count(r.id) < r.n_blocks]
    if missing:
        report = import_module("mergepipe.app.analysing").analyze_experts(catalog, missing, None, progress)
        reporter.note(f"hashed {', '.join(missing)} in {report.seconds:.1f} s (once: later plans reuse it)")


def _warn_about(made: Plan, strict: bool, reporter: Reporter) -> None:
    """What a plan's table would bury: that its output equals the base (with ``strict`` an error), and
    its warnings. A passthrough reads what its map names, from the experts or not."""
    cost = made.cost
    if cost.expert_bytes == 0 and made.copies is None:
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

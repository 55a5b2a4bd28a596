"""`plan`: a merge request planned against the catalog, without reading any expert byte.

The models the request names are resolved (directories registered on the
fly, taken back if planning fails), experts not yet analysed against the
base are analysed first when asked (that does read them, once, and loads
torch: only then is the analysis module imported), and the planner makes
the plan. What the plan would bury is said through the reporter: that its
output equals the base (an error with ``strict``), and its warnings.
"""

from __future__ import annotations

from importlib import import_module

from mergepipe.app.registering import resolved
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.errors import BudgetError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest


def plan(request: MergeRequest, db: Catalogish, *, save: bool = False, analyze_missing: bool = False,
         strict: bool = False, device: str = "cpu", progress: bool = False, reporter: Reporter = SILENT) -> Plan:
    """Plan ``request`` in catalog ``db`` (created if missing); ``save`` stores the plan for `execute`."""
    with open_catalog(db, writing=True, block_bytes=request.block_bytes, reporter=reporter) as catalog:
        made = make_plan(catalog, request, analyze_missing=analyze_missing, strict=strict, device=device,
                         progress=progress, reporter=reporter)
        if save:
            catalog.plans.save(made.digest, made.to_json_str())
    return made


def make_plan(catalog: Catalog, request: MergeRequest, *, analyze_missing: bool, strict: bool, device: str,
              progress: bool, reporter: Reporter) -> Plan:
    """The plan of ``request`` in an open catalog (see the module docstring)."""
    with resolved(catalog, request) as exact:
        if analyze_missing:
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
    missing = [e for e in experts
               if e != base and not catalog.stats.is_analyzed(catalog.models.resolve(e).id, base_id)]
    if missing:
        report = import_module("mergepipe.app.analysing").analyze_experts(catalog, missing, base, progress)
        reporter.note(f"analysed {', '.join(missing)} against '{base}' in {report.seconds:.1f} s "
                      "(once: later plans reuse it)")


def _warn_about(made: Plan, strict: bool, reporter: Reporter) -> None:
    """What a plan's table would bury: that its output equals the base (with ``strict`` an error), and
    its warnings."""
    cost = made.cost
    if cost.expert_bytes == 0:
        why = (f"the budget ({made.budget_text}) is below the cheapest useful read" if cost.full_expert_bytes
               else "every expert block is identical to the base")
        message = f"{why}: the plan reads nothing from the experts and the output equals the base"
        if strict:
            raise BudgetError(f"{message} (--strict); raise --budget, or check the experts")
        reporter.warning(f"warning: {message}")
    for note in made.notes:
        if note.startswith("warning: "):
            reporter.warning(note)

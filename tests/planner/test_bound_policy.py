"""The error bound people read: it falls as the budget grows, and the energy policy minimises it.

Before: the consensus (TIES) bound counted ``Σ_all + Σ_read`` per partly read
block, so reading more could raise it, and uniform could report a smaller
bound than energy while deviating more.
"""

from __future__ import annotations

from itertools import pairwise

import pytest

from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest

EXPERTS = ["dense", "layer1", "sparse", "attn"]
BUDGETS = ["0%", "5%", "15%", "30%", "50%", "75%", "100%"]


@pytest.mark.parametrize(("operator", "params"), [("ties", {"density": 0.5}), ("task_arithmetic", {}),
                                                   ("dare_ties", {"density": 0.5})])
def test_the_energy_bound_and_share_fall_as_the_budget_grows(f32_catalog, operator, params):
    plans = [Planner(f32_catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator=operator, params=params, budget=b)) for b in BUDGETS]
    for low, high in pairwise(plans):
        assert high.error_bound <= low.error_bound
        assert high.error_share <= low.error_share
    assert plans[0].error_share == 1.0 and plans[-1].error_share == 0.0 and plans[-1].error_bound == 0.0


@pytest.mark.parametrize("budget", ["5%", "15%", "30%", "50%"])
def test_energy_reports_a_smaller_ties_bound_than_uniform(f32_catalog, budget):
    energy = Planner(f32_catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator="ties", params={"density": 0.5}, budget=budget))
    uniform = Planner(f32_catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator="ties", params={"density": 0.5}, budget=budget, policy="uniform"))
    assert energy.error_bound < uniform.error_bound


def test_ties_energy_reads_whole_blocks_across_experts(f32_catalog):
    """A consensus block is read from every expert that changed it, or from none."""
    plan = Planner(f32_catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator="ties", params={"density": 0.5}, budget="20%"))
    for tensor, per in plan.reads.items():
        blocks = set().union(*(set(b) for b in per.values()))
        for expert in EXPERTS:
            changed = {d.index for d in f32_catalog.stats.block_deltas(expert, "base").get(tensor, [])
                       if not d.identical}
            assert set(per.get(expert, ())) == blocks & changed


def _first_order(catalog, plan, weights):
    """``sqrt(Σ_b (Σ_i w_i ||Δi_b|| over the experts not read at b)²)`` from the catalog's block norms (``w``:
    each expert's multiplier: its weight in a sum, 1 in TIES's normalised mean)."""
    total = 0.0
    for tensor in catalog.stats.block_norms(EXPERTS[0], "base"):
        norms = [catalog.stats.block_norms(e, "base")[tensor] for e in EXPERTS]
        for b in range(len(norms[0])):
            left = sum(w * (n[b] or 0.0) for w, n, e in zip(weights, norms, EXPERTS)
                       if b not in plan.reads.get(tensor, {}).get(e, ()))
            total += left**2
    return total**0.5


@pytest.mark.parametrize("budget", ["5%", "30%", "75%"])
def test_the_estimate_is_the_weighted_norm_of_the_unread_blocks(f32_catalog, budget):
    weights = [1.0, 0.5, 2.0, 0.25]
    for operator, params in (("task_arithmetic", {}), ("ties", {"density": 0.5})):
        plan = Planner(f32_catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator=operator,
                                                      weights=weights, params=params, budget=budget))
        multipliers = weights if operator == "task_arithmetic" else [1.0] * len(EXPERTS)
        assert plan.estimate == pytest.approx(_first_order(f32_catalog, plan, multipliers), rel=1e-9)
        if operator == "task_arithmetic":  # exact operators: the bound is this first-order sum
            assert plan.estimate == pytest.approx(plan.error_bound, rel=1e-12)
        else:  # a consensus bound covers sign flips: it is larger
            assert plan.estimate < plan.error_bound

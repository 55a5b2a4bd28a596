"""The a-posteriori bound of delta updates (``planner/reuse.py``): measured against the true distance
to the from-scratch merge over a chain of random updates."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from safetensors import safe_open

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_expert

UPDATES = 20
#: name -> (expert weights, the scale of the experts' and the updates' deltas (log10 range))
REGIMES = {
    "unequal weights": ({"e1": 0.7, "e2": 1.0, "e3": 0.35, "e4": 0.5}, (-4, -1.5)),
    "unit weights, small deltas": ({"e1": 1.0, "e2": 1.0, "e3": 1.0, "e4": 1.0}, (-3, -2.3)),
}


def distance(a: Path, b: Path) -> float:
    """‖a − b‖ over every tensor, in float64 (the independent reference)."""
    total = 0.0
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for name in fa.keys():
            total += float(((fa.get_tensor(name).double() - fb.get_tensor(name).double()) ** 2).sum())
    return total ** 0.5


@pytest.mark.parametrize("regime", REGIMES)
def test_the_bound_holds_and_is_within_ten_times_the_distance_over_20_random_updates(tiny_family, tmp_path,
                                                                                      regime):
    weights, scales = REGIMES[regime]

    def request(names: list[str], previous: str | None) -> MergeRequest:
        return MergeRequest(base="base", experts=names, operator="task_arithmetic", previous=previous,
                            delta_update=previous is not None, expert_params={e: {"weight": weights[e]} for e in names})

    rng = random.Random(2026)
    base = tiny_family["base"]
    experts = ["e1", "e2", "e3"]
    current = {e: make_expert(base, tmp_path / e, seed=i, scale=10 ** scales[1]) for i, e in enumerate(experts)}
    with Catalog.create(tmp_path / "c.db", 4096) as catalog:
        register(catalog, "base", base)
        for name in experts:
            register(catalog, name, current[name])
        analyze(catalog, experts, base_id="base", progress=False)
        Engine(catalog).execute(Planner(catalog).plan(request(experts, None)), out=tmp_path / "v0", model_id="chain")
        ratios = []
        for i in range(1, UPDATES + 1):
            if i == 7:  # an added expert: its earlier version is the base
                name = "e4"
                experts.append(name)
            else:  # a retrain of one expert in some of its tensors, by a random amount
                name = rng.choice(experts)
            layers = set(rng.sample(range(2), rng.randint(1, 2)))
            new = make_expert(current.get(name, base), tmp_path / f"{name}-{i}", seed=100 + i,
                              scale=10 ** rng.uniform(*scales),
                              touch=lambda n, layers=layers: any(f".layers.{k}." in n for k in layers))
            register(catalog, name, new, new_version=name in current)
            current[name] = new
            analyze(catalog, [name], base_id="base", progress=False)

            plan = Planner(catalog).plan(request(experts, "chain"))
            assert plan.reuse.updated, f"update {i} updates nothing"
            Engine(catalog).execute(plan, out=tmp_path / f"v{i}", model_id="chain")
            Engine(catalog).execute(Planner(catalog).plan(request(experts, None)), out=tmp_path / f"s{i}",
                                    model_id=f"scratch-{i}")
            bound = catalog.snapshots.error_norm(f"chain@{i + 1}")
            measured = distance(tmp_path / f"v{i}", tmp_path / f"s{i}")
            assert measured <= bound < plan.reuse.bound, (i, measured, bound, plan.reuse.bound)
            if measured > 0:
                ratios.append(bound / measured)
        assert len(ratios) >= UPDATES // 2
        assert sum(ratios) / len(ratios) <= 10, ratios

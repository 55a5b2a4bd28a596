"""Delta checkpoints as experts in merges.

The key property: an expert registered as a full checkpoint, or as its exported F32 delta under the
same id in another catalog (ids key DARE's random streams and the kernels' summation order), merges
to the same bytes — at a full budget and at a partial one (same plan reads: an F32 base, so the
delta's blocks cost what the expert's do). The reference is the merge of the full checkpoints; the
budget checks count reads with a spy and compute the delta's block sizes from its raw header.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.export_delta import export_delta
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.app.reports import explain
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.catalog.helpers import block_rows
from tests.fixtures.checkpoints import load_tensors, make_base, make_expert
from tests.planner.support import make_sparse_expert, raw_layout, snapshot_files, spy_reads

BLOCK = 2048
SEED = 11
CASES = {
    "ties": ("ties", {"density": 0.5}, [1.0, 0.7]),
    "task_arithmetic": ("task_arithmetic", {"lambda": 0.8}, [1.0, 0.5]),
    "dare_ties": ("dare_ties", {"density": 0.6}, [1.0, 0.7]),
    "dare_linear": ("dare_linear", {"density": 0.5}, [0.6, 0.4]),
    # whole-tensor paths: an off-grid density (thresholds from the whole tensor), a tensor-level operator
    "ties_offgrid": ("ties", {"density": 0.37}, [1.0, 0.7]),
    "model_stock": ("model_stock", {}, None),
}


def _family(root: Path, dtype: str) -> dict[str, Path]:
    base = make_base(root / "base", dtype=dtype, seed=4)
    return {"base": base, "x": make_expert(base, root / "x", seed=31),
            "y": make_sparse_expert(base, root / "y", seed=32, tensor_fraction=0.7, row_fraction=0.5)}


def _full_catalog(path: Path, family: dict[str, Path]) -> Catalog:
    catalog = Catalog.create(path, block_bytes=BLOCK)
    for model_id, directory in family.items():
        register_model(catalog, model_id, directory)
    analyze(catalog, ["x", "y"], base_id="base", progress=False)
    return catalog


def _delta_catalog(path: Path, family: dict[str, Path], deltas: dict[str, Path]) -> Catalog:
    """``family`` with the experts in ``deltas`` registered as those delta checkpoints, same ids."""
    catalog = Catalog.create(path, block_bytes=BLOCK)
    register_model(catalog, "base", family["base"])
    for model_id in ("x", "y"):
        if model_id in deltas:
            register_model(catalog, model_id, deltas[model_id], kind="delta", base="base")
        else:
            register_model(catalog, model_id, family[model_id])
    analyze(catalog, ["x", "y"], base_id="base", progress=False)
    return catalog


@pytest.fixture(scope="module")
def f32_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("deltas32")
    family = _family(root, "f32")
    full = _full_catalog(root / "full.db", family)
    deltas = {}
    for model_id in ("x", "y"):
        export_delta(full, model_id, root / f"{model_id}-delta")
        deltas[model_id] = root / f"{model_id}-delta"
    catalogs = {"full": full, "y": _delta_catalog(root / "y.db", family, {"y": deltas["y"]}),
                "xy": _delta_catalog(root / "xy.db", family, deltas)}
    yield root, family, deltas, catalogs
    for catalog in catalogs.values():
        catalog.close()


@pytest.fixture(scope="module")
def full_merges() -> dict:
    """(case, budget) tag -> the full-checkpoint merge's (plan, manifest), merged once for both delta catalogs."""
    return {}


def _merge(catalog: Catalog, out: Path, case: str, budget: str | None, **options):
    operator, params, weights = CASES[case]
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["x", "y"], operator=operator, weights=weights, params=params, seed=SEED, budget=budget, **options))
    _, manifest = Engine(catalog).execute(plan, out=out, model_id=out.name)
    return plan, manifest


def _weights(directory: Path) -> dict[str, bytes]:
    return {n: b for n, b in snapshot_files(directory).items() if n.endswith(".safetensors")}


@pytest.mark.parametrize("budget", [None, "40%"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("which", ["y", "xy"])
def test_full_and_f32_delta_experts_merge_to_the_same_bytes(f32_setup, full_merges, case, budget, which):
    root, _, _, catalogs = f32_setup
    tag = f"{case}-{budget or 'all'}".replace("%", "")
    if tag not in full_merges:
        full_merges[tag] = _merge(catalogs["full"], root / f"full-{tag}", case, budget)
    plan_full, manifest_full = full_merges[tag]
    plan_delta, manifest_delta = _merge(catalogs[which], root / f"delta-{tag}-{which}", case, budget)
    assert plan_delta.reads == plan_full.reads
    if budget is not None:
        assert 0 < plan_full.cost.expert_bytes < plan_full.cost.full_expert_bytes  # really a partial read
    assert _weights(root / f"delta-{tag}-{which}") == _weights(root / f"full-{tag}")
    assert manifest_delta.cost.realized.expert_bytes_by_model == manifest_full.cost.realized.expert_bytes_by_model
    assert manifest_delta.extra["expert_kinds"] == {e: "delta" for e in which}
    assert "expert_kinds" not in manifest_full.extra


def test_a_bf16_base_with_f32_deltas_merges_to_the_same_bytes(tmp_path):
    family = _family(tmp_path, "bf16")
    full = _full_catalog(tmp_path / "full.db", family)
    export_delta(full, "y", tmp_path / "y-delta")
    mixed = _delta_catalog(tmp_path / "mixed.db", family, {"y": tmp_path / "y-delta"})
    _merge(full, tmp_path / "full-out", "ties", None)
    _merge(mixed, tmp_path / "delta-out", "ties", None)
    assert _weights(tmp_path / "delta-out") == _weights(tmp_path / "full-out")


def test_a_bf16_delta_merges_within_its_rounding(f32_setup, tmp_path):
    """Task arithmetic (weight 1) with a BF16 export of y: the delta moves each entry by at most 2⁻⁸|Δ|
    (rounding to BF16), so the F32 outputs differ by at most that plus the output's own rounding
    (2⁻²⁴|out|, with slack: 2⁻²²|out|)."""
    root, family, _, catalogs = f32_setup
    export_delta(catalogs["full"], "y", tmp_path / "y-bf16", dtype="BF16")
    catalog = _delta_catalog(tmp_path / "bf16.db", family, {"y": tmp_path / "y-bf16"})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["y"], operator="task_arithmetic", params={"lambda": 1.0}, seed=SEED))
    Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    got = load_tensors(tmp_path / "out")
    base, expert = load_tensors(family["base"]), load_tensors(family["y"])
    for name, value in got.items():
        delta = expert[name] - base[name]
        reference = base[name] + delta
        bound = 2.0**-8 * delta.abs() + 2.0**-22 * reference.abs()
        assert bool(((value - reference).abs() <= bound).all()), name


def test_reads_of_an_f32_delta_over_a_bf16_base_stay_within_plan_and_budget(tmp_path):
    """Reader counters ≤ planned ≤ budget; the delta's planned bytes are its own (F32) block sizes."""
    family = _family(tmp_path, "bf16")
    full = _full_catalog(tmp_path / "full.db", family)
    export_delta(full, "y", tmp_path / "y-delta")
    catalog = _delta_catalog(tmp_path / "d.db", family, {"y": tmp_path / "y-delta"})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["x", "y"], operator="task_arithmetic", weights=[1.0, 1.0], budget="30%"))
    expected = _delta_bytes(family["base"], tmp_path / "y-delta", plan.reads, "y")
    assert plan.cost.expert_bytes_by_model["y"] == expected > 0
    with spy_reads() as spy:
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    realized = manifest.cost.realized.expert_bytes_by_model
    assert spy.bytes_of(tmp_path / "y-delta") == realized["y"] <= plan.cost.expert_bytes_by_model["y"]
    assert manifest.cost.realized.expert_bytes <= plan.cost.expert_bytes <= plan.budget_bytes
    full_plan = Planner(catalog).plan(MergeRequest(base="base", experts=["y"], operator="task_arithmetic"))
    assert full_plan.cost.expert_bytes == _delta_bytes(family["base"], tmp_path / "y-delta", full_plan.reads, "y")
    assert full_plan.cost.expert_bytes == _changed_delta_bytes(family["base"], tmp_path / "y-delta")


def _delta_bytes(base_dir: Path, delta_dir: Path, reads: dict, expert: str) -> int:
    """Bytes of the delta's rows for the planned blocks: the base's row ranges, the delta's row size."""
    base, delta = raw_layout(base_dir), raw_layout(delta_dir)
    total = 0
    for name, per in reads.items():
        if expert not in per:
            continue
        t = delta[name]
        rows = block_rows(list(base[name].shape), 2, BLOCK)
        row_bytes = t.nbytes // (t.shape[0] if len(t.shape) >= 2 else 1)
        total += sum((rows[i][1] - rows[i][0]) * row_bytes for i in per[expert])
    return total


def _changed_delta_bytes(base_dir: Path, delta_dir: Path) -> int:
    """Bytes of every delta block holding a non-zero byte."""
    base, delta = raw_layout(base_dir), raw_layout(delta_dir)
    total = 0
    for name, t in delta.items():
        data = t.file.read_bytes()
        row_bytes = t.nbytes // (t.shape[0] if len(t.shape) >= 2 else 1)
        for r0, r1 in block_rows(list(base[name].shape), 2, BLOCK):
            begin, end = t.begin + r0 * row_bytes, t.begin + r1 * row_bytes
            total += (end - begin) if any(data[begin:end]) else 0
    return total


def test_incremental_merges_reuse_delta_blocks_and_recompute_delta_updates(f32_setup, tmp_path):
    """``--from`` reuses every block of an unchanged merge; a new version of a delta expert is not
    delta-updated (its blocks are recomputed: the result is the from-scratch merge, byte for byte)."""
    root, family, deltas, catalogs = f32_setup
    catalog = _delta_catalog(tmp_path / "inc.db", family, deltas)
    _merge(catalog, tmp_path / "m1", "task_arithmetic", None)
    again, _ = _merge(catalog, tmp_path / "m2", "task_arithmetic", None, previous="m1")
    assert again.reuse is not None and again.expert_bytes_to_read("y") == 0
    assert _weights(tmp_path / "m2") == _weights(tmp_path / "m1")
    retrained = make_expert(family["base"], tmp_path / "y2", seed=77)
    full = Catalog.create(tmp_path / "full2.db", block_bytes=BLOCK)
    register_model(full, "base", family["base"])
    register_model(full, "y", retrained)
    analyze(full, ["y"], base_id="base", progress=False)
    export_delta(full, "y", tmp_path / "y2-delta")
    register_model(catalog, "y", tmp_path / "y2-delta", kind="delta", base="base", new_version=True)
    analyze(catalog, ["y"], base_id="base", progress=False)
    updated, _ = _merge(catalog, tmp_path / "m3", "task_arithmetic", None, previous="m1", delta_update=True)
    assert not (updated.reuse and updated.reuse.updated)
    assert any("is a delta checkpoint" in note for note in updated.notes)
    scratch, _ = _merge(catalog, tmp_path / "m4", "task_arithmetic", None)
    assert _weights(tmp_path / "m3") == _weights(tmp_path / "m4")
    full.close()


def test_explain_counts_the_delta_block_sizes(f32_setup):
    _, family, deltas, catalogs = f32_setup
    plan = Planner(catalogs["xy"]).plan(MergeRequest(base="base", experts=["x", "y"], operator="ties", params={"density": 0.5}))
    by_expert = {e.expert: e for e in explain(catalogs["xy"], plan).experts}
    for expert in ("x", "y"):
        assert by_expert[expert].full_bytes == _changed_delta_bytes(family["base"], deltas[expert])
        assert by_expert[expert].planned_bytes == plan.cost.expert_bytes_by_model[expert]

"""Planner units: tiny budgets, policies, the Plan's JSON and digest, and
all-or-nothing planning of tensor-level operators."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import (
    CatalogError,
    ConfigError,
    LayoutMismatchError,
    MergePipeError,
    PlanError,
    UnknownModelError,
)
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest
from tests.planner.conftest import F32_BLOCK_BYTES
from tests.planner.support import (
    block_ranges,
    changed_blocks,
    clone_catalog,
    deltas_of,
    load_tensors,
    raw_layout,
    ref_model_stock,
    ref_slerp,
)


@pytest.mark.parametrize("budget", [0, 1, "0%", "1B"])
def test_a_budget_below_any_block_plans_no_expert_reads_and_says_so(f32_catalog, f32_family, tmp_path, budget):
    plan = Planner(f32_catalog).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="ties", params={"density": 0.5}, budget=budget))
    assert plan.reads == {} or not any(ix for per in plan.reads.values() for ix in per.values())
    assert plan.cost.expert_bytes == 0
    assert plan.cost.full_expert_bytes > 0
    assert any("reads nothing" in note for note in plan.notes), plan.notes
    if budget == 0:  # executing it reads no expert byte and writes the base
        _, manifest = Engine(f32_catalog).execute(plan, out=tmp_path / "out", model_id="tiny-budget")
        assert manifest.cost.realized.expert_bytes == 0
        base, out = load_tensors(f32_family["base"]), load_tensors(tmp_path / "out")
        assert all(torch.equal(out[n], base[n]) for n in base)


def test_policy_full_with_a_smaller_budget_is_a_config_error(f32_catalog):
    planner = Planner(f32_catalog)
    with pytest.raises(ConfigError, match="full"):
        planner.plan(MergeRequest(base="base", experts=["dense"], operator="task_arithmetic", budget="50%", policy="full"))
    full = planner.plan(MergeRequest(base="base", experts=["dense"], operator="task_arithmetic", budget="100%", policy="full"))
    assert full.cost.expert_bytes == full.cost.full_expert_bytes
    assert full.error_bound == 0.0


def test_unknown_policy_operator_and_models_are_refused(f32_catalog):
    planner = Planner(f32_catalog)
    with pytest.raises(ConfigError):
        planner.plan(MergeRequest(base="base", experts=["dense"], operator="task_arithmetic", policy="greedy"))
    with pytest.raises(ConfigError):
        planner.plan(MergeRequest(base="base", experts=["dense"], operator="frankenmerge"))
    with pytest.raises(UnknownModelError, match="nope"):
        planner.plan(MergeRequest(base="base", experts=["nope"], operator="task_arithmetic"))
    with pytest.raises(UnknownModelError, match="nobase"):
        planner.plan(MergeRequest(base="nobase", experts=["dense"], operator="task_arithmetic"))
    with pytest.raises(ConfigError):
        planner.plan(MergeRequest(base="base", experts=["base"], operator="task_arithmetic"))
    with pytest.raises(ConfigError):
        planner.plan(MergeRequest(base="base", experts=[], operator="task_arithmetic"))


def test_layout_mismatch_is_refused_listing_the_difference(f32_catalog, f32_family, tmp_path):
    from safetensors.torch import save_file

    from mergepipe.analysis.analyze import analyze
    from mergepipe.analysis.register import register_model

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_tensors(f32_family["dense"])
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_bytes((f32_family["base"] / "config.json").read_bytes())
    register_model(f32_catalog, "bad", bad)
    # Planning never analyses: analysis is where a layout mismatch is found ...
    with pytest.raises(LayoutMismatchError) as info:
        analyze(f32_catalog, ["bad"], base_id="base", progress=False)
    assert "up_proj" in str(info.value)
    assert not f32_catalog.stats.is_analyzed("bad", "base")
    # ... so the expert stays unanalysed and the planner refuses it
    with pytest.raises(CatalogError, match="mergepipe analyze"):
        Planner(f32_catalog).plan(MergeRequest(base="base", experts=["dense", "bad"], operator="task_arithmetic"))


def _plan(catalog, **overrides):
    kwargs = dict(weights=[0.7, 0.3], params={"density": 0.5}, seed=3, budget="40%", policy="energy")
    kwargs.update(overrides)
    return Planner(catalog).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="ties", **kwargs))


def test_plan_json_round_trip_and_digest(f32_catalog):
    plan = _plan(f32_catalog)
    text = plan.to_json_str()
    again = Plan.from_json(text)
    assert again == plan
    assert again.digest == plan.digest
    assert again.to_json_str() == text
    assert Plan.from_json(json.loads(text)) == plan
    data = json.loads(text)
    assert data["digest"] == plan.digest and len(plan.digest) == 64
    # an edited plan no longer matches its digest
    data["cost"]["expert_bytes"] += 1
    with pytest.raises(PlanError, match="digest"):
        Plan.from_json(data)


def test_plan_round_trip_keeps_equality_with_tensor_level_fallbacks(sharded_family, tmp_path):
    from tests.planner.support import build_catalog

    path = build_catalog(tmp_path / "c.db", F32_BLOCK_BYTES, dict(sharded_family), base="base", experts=["e1"])
    with Catalog.open(path) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1"], operator="ties", params={"density": 0.37}))
    assert plan.tensor_level
    assert Plan.from_json(plan.to_json_str()) == plan


def test_replanning_gives_the_same_digest_whatever_the_clock_and_notes(f32_template, tmp_path):
    first = clone_catalog(f32_template, tmp_path / "a.db")
    second = clone_catalog(f32_template, tmp_path / "b.db")
    with Catalog.open(first, clock=lambda: 1_000_000.0) as a, Catalog.open(second, clock=lambda: 2_000_000.0) as b:
        p1, p2 = _plan(a), _plan(b)
        p3 = _plan(a)
    assert p1.created_at != p2.created_at
    assert p1.digest == p2.digest == p3.digest
    # notes are for people: they stay outside the digest
    annotated = dataclasses.replace(p1, notes=(*p1.notes, "an explanation for people"))
    assert annotated.notes != p1.notes and annotated.digest == p1.digest
    # ... but anything that decides the result changes it
    with Catalog.open(first) as a:
        assert _plan(a, seed=4).digest != p1.digest
        assert _plan(a, weights=[0.6, 0.4]).digest != p1.digest
        assert _plan(a, budget="41%").digest != p1.digest
        assert _plan(a, policy="uniform").digest != p1.digest
        assert _plan(a, out_dtype="bf16").digest != p1.digest


def test_saved_plan_round_trips_through_the_catalog(f32_catalog):
    plan = _plan(f32_catalog)
    f32_catalog.plans.save(plan.digest, plan.to_json_str())
    assert Plan.from_json(f32_catalog.plans.get(plan.digest[:10])) == plan


@pytest.mark.parametrize(
    ("op_name", "experts", "params", "budget"),
    [
        ("slerp", ["sparse"], {"t": 0.4}, "35%"),
        ("model_stock", ["attn", "dense", "sparse"], {}, "30%"),
        ("model_stock", ["attn", "dense", "sparse"], {}, "75%"),
    ],
)
def test_tensor_level_operators_read_all_changed_blocks_of_a_tensor_or_none(
    f32_catalog, f32_family, tmp_path, op_name, experts, params, budget
):
    plan = Planner(f32_catalog).plan(MergeRequest(base="base", experts=experts, operator=op_name, params=params, budget=budget))
    changed = {e: changed_blocks(f32_family["base"], f32_family[e], F32_BLOCK_BYTES) for e in experts}
    layout = raw_layout(f32_family["base"])
    read_tensors, skipped = [], []
    for name in layout:
        reads = {e: set(plan.reads_of(name, e)) for e in experts}
        if any(reads.values()):
            assert reads == {e: changed[e][name] for e in experts}, name
            read_tensors.append(name)
        elif any(changed[e][name] for e in experts):
            skipped.append(name)
    assert read_tensors and skipped, "pick a budget that reads some tensors and skips others"
    assert plan.cost.expert_bytes <= plan.budget_bytes
    # execute: skipped tensors are the base, read ones the whole-tensor formula
    Engine(f32_catalog).execute(plan, out=tmp_path / "out", model_id=f"tl-{op_name}")
    out = load_tensors(tmp_path / "out")
    base = load_tensors(f32_family["base"])
    expert_t = [load_tensors(f32_family[e]) for e in experts]
    for name in layout:
        if name not in read_tensors:
            assert torch.equal(out[name], base[name]), name
            continue
        b, ds = deltas_of(base, expert_t, name)
        ref = ref_slerp(b, ds[0], params["t"]) if op_name == "slerp" else ref_model_stock(b, ds)
        assert torch.equal(out[name], ref), name


def test_blocks_identical_to_the_base_cost_nothing(f32_catalog, f32_family):
    """The full expert read counts only changed blocks, by raw bytes."""
    plan = Planner(f32_catalog).plan(MergeRequest(base="base", experts=["attn", "layer1"], operator="task_arithmetic", budget="100%"))
    layout = raw_layout(f32_family["base"])
    sizes = {n: [e - b for b, e in block_ranges(t, F32_BLOCK_BYTES)] for n, t in layout.items()}
    for expert in ("attn", "layer1"):
        changed = changed_blocks(f32_family["base"], f32_family[expert], F32_BLOCK_BYTES)
        expected = sum(sizes[n][i] for n, idx in changed.items() for i in idx)
        assert plan.cost.expert_bytes_by_model[expert] == expected
        total = sum(sum(s) for s in sizes.values())
        assert expected < total  # these experts leave some blocks alone
    assert plan.cost.full_expert_bytes == sum(plan.cost.expert_bytes_by_model.values())
    with pytest.raises(MergePipeError):
        Planner(f32_catalog).plan(MergeRequest(base="base", experts=["attn"], operator="task_arithmetic", budget="12 parsecs"))


def test_uniform_policy_takes_the_same_fraction_of_every_tensor(f32_catalog, f32_family):
    plan = Planner(f32_catalog).plan(MergeRequest(base="base", experts=["dense"], operator="task_arithmetic", budget="30%", policy="uniform"))
    fraction = plan.budget_bytes / plan.cost.full_expert_bytes
    changed = changed_blocks(f32_family["base"], f32_family["dense"], F32_BLOCK_BYTES)
    off = {
        name: (len(plan.reads_of(name, "dense")), len(blocks))
        for name, blocks in changed.items()
        if abs(len(plan.reads_of(name, "dense")) - fraction * len(blocks)) > 1
    }
    assert not off, f"(planned, changed) blocks far from {fraction:.0%}: {off}"

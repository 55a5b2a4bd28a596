"""Policy ``entries``: budgets buy experts' delta stores — sketch stages, or exact deltas.

Checked against references computed here: a (tensor, expert) read at sketch
level L must contribute exactly the L-stage approximation of an independent
implementation (``tests/fixtures/deltas.py``); one read exactly, its true
delta (for TIES, the top-k entries suffice). The merge must equal the
operator's plain-torch reference on those deltas, and, at a budget that
reaches the exact level everywhere, the full-read merge bit for bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from itertools import pairwise

import pytest
import torch

from mergepipe.analysis.deltastore import build_store
from mergepipe.catalog import Catalog
from mergepipe.engine import stream as compute
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError, ModelChangedError, PlanError, StalePlanError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.spec.operators import kept_count
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.deltas import ref_sketch, trim_like_catalog
from tests.planner.support import clone_catalog, ref_task_arithmetic, ref_ties

EXPERTS = ("dense", "layer1", "sparse")


@pytest.fixture
def stored(f32_catalog, tmp_path):
    """The f32 catalog with delta stores for ``EXPERTS``."""
    for expert in EXPERTS:
        build_store(f32_catalog, expert, "base", tmp_path / "stores")
    return f32_catalog


def _plan(catalog, operator="ties", budget="10%", experts=EXPERTS, **params):
    params = params or ({"density": 0.5} if operator == "ties" else {})
    return Planner(catalog).plan(MergeRequest(base="base", experts=list(experts), operator=operator, params=params, budget=budget, policy="entries"))


def _levels(plan, tensor, expert):
    """Which of chunks / sketch / blocks the plan reads for (tensor, expert)."""
    return [kind for kind, reads in (("chunks", plan.entry_reads), ("sketch", plan.sketch_reads),
                                     ("blocks", plan.reads)) if reads.get(tensor, {}).get(expert)]


@pytest.mark.parametrize("budget", ["0.5%", "3%", "10%", "40%", "100%"])
def test_plans_stay_within_budget_and_count_every_byte_they_read(stored, budget):
    plan = _plan(stored, budget=budget)
    assert plan.cost.expert_bytes <= plan.budget_bytes
    blocks = stored.blocks.by_tensor("base")
    for expert in EXPERTS:
        chunks, stages = stored.deltas.chunks(expert, "base"), stored.deltas.stages(expert, "base")
        counted = sum(sum(c.nbytes for c in chunks[t][:per[expert]])
                      for t, per in plan.entry_reads.items() if expert in per)
        counted += sum(sum(s.nbytes for s in stages[t][:per[expert]])
                       for t, per in plan.sketch_reads.items() if expert in per)
        counted += sum(blocks[t][b].nbytes for t, per in plan.reads.items() for b in per.get(expert, ()))
        assert plan.cost.expert_bytes_by_model[expert] == counted
        for tensor in chunks:
            assert len(_levels(plan, tensor, expert)) <= 1  # one level per (tensor, expert)
            assert plan.stages_of(tensor, expert) <= len(stages[tensor])
    assert all(plan.stores[e] == stored.deltas.find(e, "base").digest for e in plan.stores)


def test_small_budgets_buy_sketches_and_the_full_budget_reads_everything_exactly(stored):
    """(A greedy fill is not monotone per tensor: a unit skipped as too big at one budget may be
    taken at a larger one instead of a smaller unit; the totals rise.)"""
    def level(plan, t, e):
        kinds = _levels(plan, t, e)
        return 9 if kinds and kinds[0] != "sketch" else plan.stages_of(t, e)

    plans = [_plan(stored, budget=b) for b in ("2%", "8%", "30%", "100%")]
    pairs = [(t, e) for e in EXPERTS for t in stored.deltas.chunks(e, "base")]
    for low, high in pairwise(plans):
        assert sum(level(low, t, e) for t, e in pairs) <= sum(level(high, t, e) for t, e in pairs)
        assert low.cost.expert_bytes <= high.cost.expert_bytes
    assert plans[0].sketch_reads and not plans[0].entry_reads  # a small budget buys sketches
    assert all(level(plans[-1], t, e) == 9 for t, e in pairs)  # the full budget reads everything exactly


def test_ties_exact_reads_stop_at_the_top_k_entries(stored):
    plan = _plan(stored, budget="100%", density=0.2)
    numel = {t.name: t.numel for t in stored.models.tensors("base")}
    assert plan.entry_reads
    for tensor, per in plan.entry_reads.items():
        for expert, n in per.items():
            chunks = stored.deltas.chunks(expert, "base")[tensor]
            k = kept_count(0.2, numel[tensor])
            assert sum(c.entries for c in chunks[: n - 1]) < k
            assert n == len(chunks) or sum(c.entries for c in chunks[:n]) >= k


def test_the_full_budget_gives_the_full_read_ties_merge_bit_for_bit(stored, tmp_path):
    entries = _plan(stored, budget="100%")
    assert entries.error_bound == 0.0
    assert any("equals the full-read merge" in n for n in entries.notes)
    full = Planner(stored).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, budget="100%"))
    Engine(stored).execute(entries, out=tmp_path / "entries", model_id="entries")
    Engine(stored).execute(full, out=tmp_path / "full", model_id="full")
    assert (tmp_path / "entries/model.safetensors").read_bytes() == (tmp_path / "full/model.safetensors").read_bytes()


def _read_delta(plan, catalog, name, expert, true_delta):
    """The delta the plan gives the kernel for (tensor, expert), from the references."""
    if plan.stages_of(name, expert):
        return ref_sketch(true_delta, plan.stages_of(name, expert))[-1]
    if plan.chunks_of(name, expert):  # the top entries of the chunks read, exact
        m = sum(c.entries for c in catalog.deltas.chunks(expert, "base")[name][: plan.chunks_of(name, expert)])
        flat = true_delta.reshape(-1)
        keep = torch.zeros(flat.numel(), dtype=torch.bool)
        keep[torch.sort(flat.abs(), descending=True, stable=True).indices[:m]] = True
        return torch.where(keep, flat, 0.0).reshape(true_delta.shape)
    if plan.reads.get(name, {}).get(expert):
        return true_delta
    return torch.zeros_like(true_delta)


@pytest.mark.parametrize(("operator", "budget"), [("ties", "3%"), ("ties", "12%"), ("task_arithmetic", "6%"),
                                                  ("task_arithmetic", "30%")])
@pytest.mark.parametrize("piece_elements", [None, 1, 100])
def test_a_partial_budget_merges_exactly_what_it_reads(stored, f32_family, tmp_path, monkeypatch, operator, budget,
                                                       piece_elements):
    """Merged whole (None: a piece of 2**17 elements holds any tensor of these models) or in pieces of one
    row (1) or a few rows (100), the same values."""
    if piece_elements is not None:
        monkeypatch.setattr(compute, "CPU_PIECE_ELEMENTS", piece_elements)
    plan = _plan(stored, operator, budget)
    assert plan.sketch_reads
    _, manifest = Engine(stored).execute(plan, out=tmp_path / "out", model_id="out")
    assert manifest.cost.realized.expert_bytes_by_model == plan.cost.expert_bytes_by_model
    base = load_tensors(f32_family["base"])
    experts = [load_tensors(f32_family[e]) for e in EXPERTS]
    merged = load_tensors(tmp_path / "out")
    for name, b in base.items():
        true = [e[name] - b for e in experts]
        deltas = [_read_delta(plan, stored, name, eid, d) for d, eid in zip(true, EXPERTS)]
        if operator == "ties":
            trimmed = [trim_like_catalog(d, t, 0.5) for d, t in zip(deltas, true)]
            expected = ref_ties(b, trimmed, [1.0] * 3, 1.0)
        else:
            expected = ref_task_arithmetic(b, deltas, [1.0] * 3)
        assert torch.equal(merged[name], expected), name


def test_experts_without_a_store_are_read_by_blocks(f32_catalog, tmp_path):
    build_store(f32_catalog, "dense", "base", tmp_path / "stores")
    plan = _plan(f32_catalog, "task_arithmetic", "30%", experts=("dense", "sparse"))
    assert {e for per in plan.sketch_reads.values() for e in per} == {"dense"}
    assert not any("sparse" in per for per in plan.entry_reads.values())
    assert "sparse" in {e for per in plan.reads.values() for e in per}
    assert set(plan.stores) == {"dense"}
    assert plan.cost.expert_bytes <= plan.budget_bytes
    _, manifest = Engine(f32_catalog).execute(plan, out=tmp_path / "out", model_id="out")
    assert manifest.cost.realized.expert_bytes_by_model == plan.cost.expert_bytes_by_model


def test_entries_beat_blocks_on_the_same_budget(stored, f32_family, tmp_path):
    """At 10% sketches of every delta keep far more of the task vector than the best blocks."""
    base = load_tensors(f32_family["base"])
    errors, estimates = {}, {}
    for policy in ("energy", "entries"):
        plan = Planner(stored).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic",
                                                 budget="10%", policy=policy))
        estimates[policy] = plan.estimate
        Engine(stored).execute(plan, out=tmp_path / policy, model_id=policy)
        merged = load_tensors(tmp_path / policy)
        full = {n: ref_task_arithmetic(b, [load_tensors(f32_family[e])[n] - b for e in EXPERTS], [1.0] * 3)
                for n, b in base.items()}
        errors[policy] = sum(float(((merged[n] - full[n]).double() ** 2).sum()) for n in base) ** 0.5
    assert errors["entries"] < 0.5 * errors["energy"]
    # the plans' first-order estimates rank them as their measured deviation does, and bound it here (an exact
    # operator: the estimate is its bound)
    assert estimates["entries"] < estimates["energy"]
    assert errors["entries"] <= estimates["entries"] and errors["energy"] <= estimates["energy"]


def test_plan_json_round_trips_and_old_plans_keep_their_form(stored):
    plan = _plan(stored)
    again = Plan.from_json(plan.to_json_str())
    assert again == plan and again.digest == plan.digest
    data = json.loads(plan.to_json_str())
    tensor = next(iter(data["entries"]["sketch"]))
    expert = next(iter(data["entries"]["sketch"][tensor]))
    data["entries"]["sketch"][tensor][expert] += 1
    with pytest.raises(PlanError, match="digest mismatch"):
        Plan.from_json(data)
    energy = Planner(stored).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, budget="10%", policy="energy"))
    assert "entries" not in energy.to_json() and energy.entry_reads == {}


def test_without_a_policy_a_budgeted_plan_reads_the_stores_when_every_expert_has_one(f32_template, stored,
                                                                                     tmp_path):
    def planned(catalog, experts, budget="10%", operator="ties"):
        params = {"density": 0.5} if operator == "ties" else {}
        return Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator=operator, params=params,
                                                  budget=budget))

    chosen = planned(stored, list(EXPERTS))
    explicit = Planner(stored).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties",
                                                 params={"density": 0.5}, budget="10%", policy="entries"))
    assert chosen.policy == "entries" and chosen.digest == explicit.digest  # the same plan as asked for by name
    assert planned(stored, list(EXPERTS), budget="100%").policy == "energy"  # a full read: nothing to choose
    with Catalog.open(clone_catalog(f32_template, tmp_path / "bare.db")) as bare:
        assert planned(bare, list(EXPERTS)).policy == "energy"  # no store
    for expert in ("attn",):  # one expert of three without a store
        assert planned(stored, ["dense", "layer1", expert]).policy == "energy"
    assert planned(stored, list(EXPERTS), operator="model_stock").policy == "energy"  # needs whole tensors


def test_entries_needs_a_store_and_a_streaming_operator(f32_catalog, stored):
    with pytest.raises(ConfigError, match="--store-deltas"):
        Planner(f32_catalog).plan(MergeRequest(base="base", experts=["attn"], operator="task_arithmetic", budget="10%", policy="entries"))
    with pytest.raises(ConfigError, match="whole tensors"):
        Planner(stored).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="model_stock", budget="10%", policy="entries"))


def test_a_tampered_store_aborts_the_merge_and_publishes_nothing(stored, tmp_path):
    plan = _plan(stored)
    path = stored.deltas.find("dense", "base").path
    tensor = next(t for t, per in plan.sketch_reads.items() if "dense" in per)
    chunk = stored.deltas.stages("dense", "base")[tensor][0]
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(chunk.end - 1)
        byte = fh.read(1)
        fh.seek(chunk.end - 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelChangedError, match=f"delta store of 'dense'.*sketch stage 1 of tensor '{tensor}'"):
        Engine(stored).execute(plan, out=tmp_path / "out", model_id="out")
    assert not (tmp_path / "out").exists()


def test_a_missing_or_different_store_is_refused_before_anything_is_written(stored, tmp_path):
    plan = _plan(stored)
    os.unlink(stored.deltas.find("dense", "base").path)
    with pytest.raises(ModelChangedError, match="is missing"):
        Engine(stored).execute(plan, out=tmp_path / "out", model_id="out")
    other = replace(plan, stores={**plan.stores, "dense": "0" * 64})
    with pytest.raises(StalePlanError, match="delta store of 'dense' was rebuilt or dropped"):
        Engine(stored).execute(other, out=tmp_path / "out", model_id="out")
    assert not (tmp_path / "out").exists()


def test_a_rebuilt_store_has_the_same_digest_and_the_plan_still_runs(stored, tmp_path):
    plan = _plan(stored)
    build_store(stored, "dense", "base", tmp_path / "stores2")
    assert stored.deltas.find("dense", "base").digest == plan.stores["dense"]
    Engine(stored).execute(plan, out=tmp_path / "out", model_id="out")

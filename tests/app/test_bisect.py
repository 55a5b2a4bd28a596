"""Bisect's search (app/bisecting.py): the changes between two real plans, hybrid requests that plan to
the digests a hand-written request gives, refusals, the culprit search against an oracle whose culprits
the test chooses, and tensor groups on real Llama and Qwen3 names."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import Counter

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError
from mergepipe.app.bisecting import (
    Change,
    changes,
    find_culprits,
    hybrid_request,
    merge_digest,
    narrow_tensors,
    tensor_groups,
)
from mergepipe.planner.planner import Planner
from mergepipe.spec.copy_map import LayerSlice
from mergepipe.spec.plan import ModelRef, Plan
from mergepipe.spec.plan import PlanReuse
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_base, make_expert
from tests.planner.conftest import f32_family, f32_template  # noqa: F401 (fixtures)
from tests.planner.support import clone_catalog, raw_layout

# ------------------------------------------------------------------------------------------ real plans


@pytest.fixture(scope="module")
def catalog(f32_template, f32_family, tmp_path_factory):
    """The f32 catalog with a second version of expert ``dense`` and of the base, each analysed."""
    root = tmp_path_factory.mktemp("bisect")
    dense2 = make_expert(f32_family["base"], root / "dense2", seed=31)
    base2 = make_base(root / "base2", arch="llama", dtype="f32", seed=6)
    with Catalog.open(clone_catalog(f32_template, root / "catalog.db")) as cat:
        register_model(cat, "dense", dense2, new_version=True)
        analyze(cat, ["dense@2"], base_id="base", progress=False)
        register_model(cat, "base", base2, new_version=True)
        analyze(cat, ["dense@1"], base_id="base@2", progress=False)
        yield cat


def plan(catalog: Catalog, **request) -> Plan:
    request.setdefault("base", "base@1")
    return Planner(catalog).plan(MergeRequest(**request))


def listed(found: list[Change]) -> list[tuple[str, str]]:
    return [(c.kind, c.description) for c in found]


GOOD = dict(experts=["dense@1", "attn"], operator="ties", params={"density": 0.5},
            expert_params={"dense@1": {"weight": 1.0}}, budget="100%")
BAD = dict(experts=["dense@2", "sparse"], operator="ties", params={"density": 0.7},
           expert_params={"dense@2": {"weight": 0.8}}, seed=3, budget="50%", policy="uniform", out_dtype="f32")
#: Each change between GOOD and BAD, and the request that is GOOD with only that change, written by hand.
ONE_CHANGE = {
    ("expert version", "dense: dense@1 -> dense@2"): {**GOOD, "experts": ["dense@2", "attn"],
                                                       "expert_params": {"dense@2": {"weight": 1.0}}},
    ("expert removed", "expert attn removed"): {**GOOD, "experts": ["dense@1"]},
    ("expert added", "expert sparse added"): {**GOOD, "experts": ["dense@1", "attn", "sparse"]},
    ("parameter", "ties density: 0.5 -> 0.7"): {**GOOD, "params": {"density": 0.7}},
    ("parameter", "ties weight of dense: 1.0 -> 0.8"): {**GOOD, "expert_params": {"dense@1": {"weight": 0.8}}},
    ("setting", "budget: 100% -> 50%"): {**GOOD, "budget": "50%"},
    ("setting", "policy: energy -> uniform"): {**GOOD, "policy": "uniform"},
    ("setting", "seed: 0 -> 3"): {**GOOD, "seed": 3},
    ("setting", "output dtype: base's -> F32"): {**GOOD, "out_dtype": "f32"},
}


def test_changes_list_every_difference_of_two_real_plans_in_a_stable_order(catalog):
    good, bad = plan(catalog, **GOOD), plan(catalog, **BAD)
    assert listed(changes(good, bad)) == list(ONE_CHANGE)
    assert changes(good, bad) == changes(good, bad)


def test_hybrids_plan_to_good_bad_and_each_hand_written_one_change_merge(catalog):
    good, bad = plan(catalog, **GOOD), plan(catalog, **BAD)
    found = changes(good, bad)
    planner = Planner(catalog)
    assert planner.plan(hybrid_request(good, bad, [])).digest == good.digest == merge_digest(good)
    assert planner.plan(hybrid_request(good, bad, found)).digest == bad.digest
    for change in found:
        expected = plan(catalog, **ONE_CHANGE[(change.kind, change.description)])
        assert planner.plan(hybrid_request(good, bad, [change])).digest == expected.digest, change.description
    version = hybrid_request(good, bad, [found[0]])
    assert (version.base, version.experts) == ("base@1", ("dense@2", "attn@1"))  # exact versions


def test_two_changes_together_match_the_hand_written_merge(catalog):
    good, bad = plan(catalog, **GOOD), plan(catalog, **BAD)
    by_what = {c.description: c for c in changes(good, bad)}
    subset = [by_what["expert sparse added"], by_what["dense: dense@1 -> dense@2"]]
    expected = plan(catalog, **{**GOOD, "experts": ["dense@2", "attn", "sparse"],
                                "expert_params": {"dense@2": {"weight": 1.0}}})
    assert Planner(catalog).plan(hybrid_request(good, bad, subset)).digest == expected.digest


def test_a_parameter_only_one_operator_takes_travels_with_the_operator_change(catalog):
    good = plan(catalog, experts=["dense@1", "attn"], operator="ties", params={"density": 0.5})
    bad = plan(catalog, experts=["dense@1", "attn"], operator="linear", expert_params={"attn": {"weight": 2.0}})
    found = changes(good, bad)
    assert listed(found) == [
        ("parameter", "weight of attn: unset -> 2.0"),
        ("setting", "operator: ties -> linear (with density, which only one of them takes)"),
    ]
    planner = Planner(catalog)
    weight, operator = found
    assert planner.plan(hybrid_request(good, bad, [weight])).digest == plan(
        catalog, experts=["dense@1", "attn"], operator="ties", params={"density": 0.5},
        expert_params={"attn": {"weight": 2.0}}).digest
    assert planner.plan(hybrid_request(good, bad, [operator])).digest == plan(
        catalog, experts=["dense@1", "attn"], operator="linear").digest
    assert planner.plan(hybrid_request(good, bad, found)).digest == bad.digest


def test_the_order_of_the_experts_and_the_output_options_are_changes_too(catalog):
    good = plan(catalog, experts=["dense@1", "attn"], operator="task_arithmetic", budget=0)
    bad = plan(catalog, experts=["attn", "dense@1"], operator="task_arithmetic", budget="none",
               out_shard_bytes="1MB", copy_tokenizer=False)
    found = changes(good, bad)
    assert listed(found) == [
        ("setting", "budget: 0 -> none"),
        ("setting", "output shards: base's files -> at most 976.6 KiB"),
        ("setting", "tokenizer files: copied -> left out"),
        ("setting", "expert order: dense, attn -> attn, dense"),
    ]
    planner = Planner(catalog)
    assert planner.plan(hybrid_request(good, bad, [])).digest == good.digest
    assert planner.plan(hybrid_request(good, bad, found)).digest == bad.digest
    assert planner.plan(hybrid_request(good, bad, [found[-1]])).digest == plan(
        catalog, experts=["attn", "dense@1"], operator="task_arithmetic", budget=0).digest


def test_blocks_reused_from_a_previous_snapshot_are_the_same_merge(catalog):
    good, bad = plan(catalog, **GOOD), plan(catalog, **BAD)
    reused = dataclasses.replace(good, reuse=PlanReuse("good-v1", "0" * 64, {}, 0))
    assert reused.digest != good.digest and merge_digest(reused) == good.digest
    assert changes(reused, bad) == changes(good, bad)
    assert Planner(catalog).plan(hybrid_request(reused, bad, [])).digest == merge_digest(reused)


def refusal(good: Plan, bad: Plan) -> str:
    with pytest.raises(ConfigError) as caught:
        changes(good, bad)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_plans_onto_other_bases_or_versions_of_the_base_are_refused_naming_them(catalog):
    good = plan(catalog, experts=["dense@1"], operator="task_arithmetic")
    on_base2 = plan(catalog, base="base@2", experts=["dense@1"], operator="task_arithmetic")
    assert refusal(good, on_base2) == ("GOOD and BAD merge onto different versions of base: base@1 (GOOD) and "
                                       "base@2 (BAD); bisect compares merges onto one base")
    elsewhere = dataclasses.replace(good, base=ModelRef("conc1", good.base.fingerprint))
    assert refusal(elsewhere, good).startswith("GOOD and BAD merge onto different bases: conc1 (GOOD) and base (BAD)")


def test_the_same_merge_twice_is_refused(catalog):
    good = plan(catalog, **GOOD)
    assert refusal(good, plan(catalog, **GOOD)).startswith("GOOD and BAD are the same merge")


def test_plans_no_request_can_make_again_are_refused_by_name(catalog):
    good = plan(catalog, **GOOD)
    passthrough = plan(catalog, operator="passthrough", experts=["dense@1"],
                       slices=(LayerSlice("base@1", 0, 1), LayerSlice("dense@1", 1, 2)))
    assert passthrough.copies is not None
    assert "GOOD is a passthrough" in refusal(passthrough, good)
    timed = dataclasses.replace(good, budget_text="20s")
    assert f"merge BAD with --budget {good.budget_bytes}B" in refusal(good, timed)
    updated = dataclasses.replace(good, reuse=PlanReuse("good-v1", "0" * 64, {}, 0, updated={"lm_head.weight": (0,)}))
    assert "--delta-update" in refusal(updated, plan(catalog, **BAD))
    forced = dataclasses.replace(good, experts=(ModelRef("dense", "f" * 64), *good.experts[1:]))
    assert "model dense has other content in BAD's plan" in refusal(good, forced)


def test_a_hybrid_that_is_no_merge_is_one_line_and_a_foreign_change_a_bug(catalog):
    good = plan(catalog, experts=["dense@1"], operator="task_arithmetic")
    bad = plan(catalog, experts=["attn"], operator="task_arithmetic")
    removed, added = changes(good, bad)
    assert (removed.description, added.description) == ("expert dense removed", "expert attn added")
    with pytest.raises(ConfigError, match="^GOOD with expert dense removed from BAD is not a merge: .*expert"):
        hybrid_request(good, bad, [removed])
    with pytest.raises(ValueError, match="not changes between GOOD and BAD"):
        hybrid_request(good, bad, [Change("setting", "seed: 0 -> 1", ("seed",))])


# ------------------------------------------------------------------------------------------ the search


def ceil_log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def run(n: int, regresses) -> tuple:
    """find_culprits over range(n) with an oracle that records every call; checks the calls against the
    search's probes: each once, never GOOD or BAD, each answer the oracle's."""
    calls = []

    def oracle(subset: frozenset) -> bool:
        calls.append(subset)
        return regresses(subset)

    search = find_culprits(range(n), oracle)
    assert [p.subset for p in search.probes] == calls
    assert len(set(calls)) == len(calls)
    assert frozenset() not in calls and frozenset(range(n)) not in calls
    assert all(p.regresses == regresses(p.subset) for p in search.probes)
    return set(search.culprits), search.evaluations


def test_one_culprit_among_n_costs_at_most_ceil_log2_n_plus_2():
    for n in range(1, 65):
        for culprit in range(n):
            found, spent = run(n, lambda s: culprit in s)
            assert found == {frozenset({culprit})}
            assert spent <= ceil_log2(n) + 2, (n, culprit, spent)


@pytest.mark.parametrize("n", [*range(2, 20), 31, 32, 33, 47, 63, 64])
def test_two_independent_culprits_cost_at_most_2_ceil_log2_n_plus_4(n):
    for a, b in itertools.combinations(range(n), 2):
        found, spent = run(n, lambda s: a in s or b in s)
        assert found == {frozenset({a}), frozenset({b})}
        assert spent <= 2 * ceil_log2(n) + 4, (n, a, b, spent)


def test_several_independent_culprits_are_each_found():
    rng = random.Random(7)
    for n in range(3, 65):
        for _ in range(20):
            culprits = rng.sample(range(n), rng.randint(3, min(n, 5)))
            found, spent = run(n, lambda s: any(c in s for c in culprits))
            assert found == {frozenset({c}) for c in culprits}
            assert spent <= len(culprits) * (ceil_log2(n) + 2)


@pytest.mark.parametrize("size", [2, 3])
def test_an_interaction_is_narrowed_to_the_items_it_needs(size):
    rng = random.Random(size)
    for n in range(size, 65):
        sets = list(itertools.combinations(range(n), size)) if n <= 10 else [rng.sample(range(n), size)
                                                                                for _ in range(15)]
        for chosen in sets:
            culprit = frozenset(chosen)
            found, spent = run(n, lambda s: culprit <= s)
            assert found == {culprit}, (n, culprit)
            assert spent <= (size + 1) * (ceil_log2(n) + 2), (n, culprit, spent)


def test_an_interaction_and_an_independent_culprit_are_told_apart():
    rng = random.Random(11)
    for n in range(3, 65):
        for _ in range(10):
            alone, a, b = rng.sample(range(n), 3)
            found, _ = run(n, lambda s: alone in s or {a, b} <= s)
            assert found == {frozenset({alone}), frozenset({a, b})}


def test_culprits_come_in_the_order_found_with_any_hashable_items():
    search = find_culprits(["seed", "math", "code", "budget"], lambda s: "code" in s or "seed" in s)
    assert search.culprits == (frozenset({"seed"}), frozenset({"code"}))
    with pytest.raises(ValueError, match="no items"):
        find_culprits([], lambda s: True)
    with pytest.raises(ValueError, match="distinct"):
        find_culprits(["a", "a"], lambda s: True)


# ------------------------------------------------------------------------------------------ tensor groups


def expected_groups(names: list[str]) -> dict[str, dict[str, set[str]]]:
    """Group -> part -> tensors, from the names of a two-layer Hugging Face Llama/Qwen3 checkpoint."""
    groups: dict[str, dict[str, set[str]]] = {}
    for name in names:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            module = parts[3]
            kind = "norms" if module.endswith("layernorm") else {"self_attn": "attention", "mlp": "MLP"}[module]
            group = f"model.layers.{parts[2]}"
            groups.setdefault(group, {}).setdefault(f"{group} {kind}", set()).add(name)
        else:
            group = {"model.embed_tokens.weight": "embeddings", "model.norm.weight": "final norm",
                     "lm_head.weight": "lm_head"}[name]
            groups.setdefault(group, {}).setdefault(group, set()).add(name)
    return groups


@pytest.mark.parametrize("family, order", [
    ("tiny_family", ["embeddings", "model.layers.0", "model.layers.1", "final norm", "lm_head"]),
    ("sharded_family", ["embeddings", "model.layers.0", "model.layers.1", "final norm"]),  # tied: no lm_head
])
def test_every_tensor_of_a_real_checkpoint_is_in_exactly_one_group(request, family, order):
    names = list(raw_layout(request.getfixturevalue(family)["base"]))
    groups = tensor_groups(names)
    assert [g.name for g in groups] == order
    expected = expected_groups(names)
    for group in groups:
        parts = group.parts or (group,)
        assert {p.name: set(p.tensors) for p in parts} == expected[group.name]
        assert Counter(t for p in parts for t in p.tensors) == Counter(group.tensors)
    assert Counter(t for g in groups for t in g.tensors) == Counter(names)
    kinds = tensor_groups(names, by="kind")
    assert [g.name for g in kinds] == [part for group in order for part in (
        [f"{group} {kind}" for kind in ("attention", "MLP", "norms")] if group.startswith("model.layers") else [group])]
    assert {g.name: set(g.tensors) for g in kinds} == {k: v for parts in expected.values() for k, v in parts.items()}
    if family == "sharded_family":  # Qwen3's q/k norms belong to attention
        assert "model.layers.0.self_attn.q_norm.weight" in groups[1].parts[0].tensors


def test_layers_of_other_layouts_group_by_number_and_kind():
    names = ["transformer.wte.weight", "transformer.h.10.mlp.c_fc.weight", "transformer.h.2.ln_1.weight",
             "transformer.h.2.attn.c_attn.weight", "transformer.h.2.mlp.c_proj.weight", "transformer.ln_f.weight",
             "rotary.inv_freq", "blocks.0.ffn.w1.weight", "blocks.0.attn_norm.weight"]
    groups = tensor_groups(names)
    summary = [(g.name, g.tensors, [(p.name, p.tensors) for p in g.parts]) for g in groups]
    assert summary == [
        ("embeddings", ("transformer.wte.weight",), []),
        ("transformer.h.2", ("transformer.h.2.ln_1.weight", "transformer.h.2.attn.c_attn.weight",
                             "transformer.h.2.mlp.c_proj.weight"),
         [("transformer.h.2 attention", ("transformer.h.2.attn.c_attn.weight",)),
          ("transformer.h.2 MLP", ("transformer.h.2.mlp.c_proj.weight",)),
          ("transformer.h.2 norms", ("transformer.h.2.ln_1.weight",))]),
        ("transformer.h.10", ("transformer.h.10.mlp.c_fc.weight",), []),
        ("blocks.0", ("blocks.0.ffn.w1.weight", "blocks.0.attn_norm.weight"),
         [("blocks.0 MLP", ("blocks.0.ffn.w1.weight",)), ("blocks.0 norms", ("blocks.0.attn_norm.weight",))]),
        ("final norm", ("transformer.ln_f.weight",), []),
        ("other tensors", ("rotary.inv_freq",), []),
    ]


def test_narrowing_finds_the_kind_of_tensor_in_the_layer_that_regresses(tiny_family):
    names = list(raw_layout(tiny_family["base"]))
    search = narrow_tensors(names, lambda s: "model.layers.1.mlp.down_proj.weight" in s)
    [[culprit]] = [list(c) for c in search.culprits]
    assert culprit.name == "model.layers.1 MLP"
    assert set(culprit.tensors) == {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert search.evaluations <= (ceil_log2(5) + 2) + (ceil_log2(3) + 2)
    evaluated = [frozenset(t for g in p.subset for t in g.tensors) for p in search.probes]
    assert len(set(evaluated)) == len(evaluated)


def test_narrowing_reports_an_interaction_across_layers_and_a_group_outside_them(tiny_family):
    names = list(raw_layout(tiny_family["base"]))
    needed = {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    search = narrow_tensors(names, lambda s: needed <= s)
    assert [sorted(g.name for g in c) for c in search.culprits] == [["model.layers.0 attention",
                                                                    "model.layers.1 MLP"]]
    outside = narrow_tensors(names, lambda s: "model.embed_tokens.weight" in s)
    assert [[g.name for g in c] for c in outside.culprits] == [["embeddings"]]

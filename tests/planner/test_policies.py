"""The budget-spending policies and the error bound, against plain Python.

``greedy_fill`` is a vectorised version of a one-line loop; ``error_bound``
a numpy version of a per-block formula. Each is compared here with that
loop or formula written out in Python, on random inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.catalog.records import TensorRecord
from mergepipe.planner.policies import error_bound
from mergepipe.planner.policies import choose, greedy_fill
from mergepipe.planner.policies import TensorPlan, Units

BOUND_KINDS = ("exact", "separable", "consensus", "none")


# ----------------------------------------------------------------------------- greedy fill


def sequential_fill(ranked: list[int], cost: list[int], budget: int, spent: int) -> tuple[list[int], int]:
    """The contract: walk ``ranked``, add unit i if spent + cost <= budget."""
    taken = []
    for i in ranked:
        if spent + cost[i] <= budget:
            taken.append(i)
            spent += cost[i]
    return taken, spent


@st.composite
def fill_cases(draw):
    """Costs with zeros and repeats, a ranking, a budget and what was already spent."""
    n = draw(st.integers(0, 40))
    cost = draw(st.lists(st.one_of(st.just(0), st.integers(0, 5), st.integers(0, 1000)), min_size=n, max_size=n))
    ranked = draw(st.permutations(list(range(n))))
    total = sum(cost)
    prefix_sums = [sum(cost[i] for i in ranked[:k]) for k in range(n + 1)]
    budget = draw(st.one_of(
        st.just(0),
        st.just(total),  # exactly everything
        st.sampled_from(prefix_sums),  # exactly a prefix
        st.integers(0, total + 10),
        st.just(10**15),  # far more than everything
    ))
    spent = draw(st.one_of(st.just(0), st.integers(0, budget)))
    return ranked, cost, budget, spent


@settings(max_examples=400, deadline=None)
@given(fill_cases())
def test_greedy_fill_equals_the_sequential_loop(case):
    ranked, cost, budget, spent = case
    taken, total = greedy_fill(np.array(ranked, dtype=np.int64), np.array(cost, dtype=np.int64), budget, spent)
    expected, expected_total = sequential_fill(ranked, cost, budget, spent)
    assert [int(i) for i in taken] == expected
    assert total == expected_total
    assert total <= max(budget, spent)


def test_greedy_fill_skips_a_unit_that_does_not_fit_and_goes_on():
    # 6 fits, 5 does not (11 > 10), 4 does (10), the zero-cost unit always does
    taken, spent = greedy_fill(np.array([0, 1, 2, 3]), np.array([6, 5, 4, 0]), 10, 0)
    assert taken.tolist() == [0, 2, 3] and spent == 10


def _units(cost: list[int], value: list[float]) -> Units:
    n = len(cost)
    return Units(
        tensor=np.zeros(n, dtype=np.int64), expert=np.zeros(n, dtype=np.int64), block=np.arange(n, dtype=np.int64),
        cost=np.array(cost, dtype=np.int64), value=np.array(value, dtype=np.float64),
        rank=np.arange(n, dtype=np.uint64)[::-1].copy(),
    )


def test_energy_ties_keep_creation_order():
    """Equal value per byte: the units created first win, whatever their size."""
    units = _units([20, 10, 10, 20, 10], [2.0, 1.0, 1.0, 2.0, 1.0])  # every ratio 0.1
    assert choose(units, 30, "energy", ["t"]).tolist() == [0, 1]
    assert choose(units, 40, "energy", ["t"]).tolist() == [0, 1, 2]
    same = _units([10] * 6, [1.0] * 6)
    assert choose(same, 35, "energy", ["t"]).tolist() == [0, 1, 2]


def test_energy_takes_higher_value_per_byte_first():
    units = _units([10, 10, 10, 10], [1.0, 4.0, 2.0, 4.0])
    assert choose(units, 20, "energy", ["t"]).tolist() == [1, 3]
    assert choose(units, 30, "energy", ["t"]).tolist() == [1, 3, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.sampled_from([0.0, 0.5, 1.0, 2.0])), max_size=30),
       st.integers(0, 600))
def test_energy_equals_a_stable_sort_by_ratio_then_the_loop(pairs, budget):
    cost = [c for c, _ in pairs]
    value = [v * c for c, v in pairs]  # few distinct ratios: many ties
    ratio = [value[i] / cost[i] for i in range(len(cost))]
    ranked = sorted(range(len(cost)), key=lambda i: -ratio[i])  # Python's sort is stable
    expected, _ = sequential_fill(ranked, cost, budget, 0)
    assert choose(_units(cost, value), budget, "energy", ["t"]).tolist() == expected


# ----------------------------------------------------------------------------- error bound


def reference_bound(tensors: list[dict], reads: dict[int, dict[int, list[int]]]) -> tuple[float, str]:
    """The per-block formula of the error bound (planner/policies.py), in plain Python.

    Per block, w_i = beta_i ||Δi_b|| (beta inf counts as 1, unchanged blocks
    as 0); nothing omitted (zero omitted weight) contributes 0, else
    exact/separable/none contribute (Σ_omitted w)² and consensus
    (2 Σ_all w)². Sums in expert order, then blocks in tensor order.
    """
    total = 0.0
    kinds = set()
    for t, tensor in enumerate(tensors):
        kinds.add(tensor["kind"])
        l2, beta = tensor["l2"], tensor["beta"]
        for b in range(len(l2[0])):
            everything = read_part = omitted = 0.0
            for i in range(len(l2)):
                weight = 0.0 if math.isnan(l2[i][b]) else (beta[i] if math.isfinite(beta[i]) else 1.0) * l2[i][b]
                everything += weight
                if b in reads.get(t, {}).get(i, []):
                    read_part += weight
                else:
                    omitted += weight
            if omitted == 0.0:
                continue
            # squares as products: x * x is exactly rounded, while x ** 2 goes
            # through the C library's pow(), which may differ in the last bit
            if tensor["kind"] == "consensus":
                total += (everything + everything) * (everything + everything)
            else:
                total += omitted * omitted
    return math.sqrt(total), ("estimate" if "none" in kinds else "bound")


def reference_share(tensors: list[dict], reads: dict[int, dict[int, list[int]]]) -> float:
    """sqrt(Σ omitted w² / Σ w²) over every (expert, block), expert-major within each tensor."""
    everything = omitted = 0.0
    for t, tensor in enumerate(tensors):
        l2, beta = tensor["l2"], tensor["beta"]
        for i in range(len(l2)):
            for b in range(len(l2[0])):
                weight = 0.0 if math.isnan(l2[i][b]) else (beta[i] if math.isfinite(beta[i]) else 1.0) * l2[i][b]
                everything += weight * weight
                if b not in reads.get(t, {}).get(i, []):
                    omitted += weight * weight
    return min(math.sqrt(omitted / everything), 1.0) if everything > 0 else 0.0


def _tensor_plan(index: int, tensor: dict) -> TensorPlan:
    experts, blocks = len(tensor["l2"]), len(tensor["l2"][0])
    record = TensorRecord(f"t{index}", "model.safetensors", "F32", (blocks, 4), 0, blocks * 16, index)
    return TensorPlan(
        record=record, block_bytes=np.full(blocks, 16, dtype=np.int64),
        l2=np.array(tensor["l2"], dtype=np.float64), beta=list(tensor["beta"]), bound_kind=tensor["kind"],
        tensor_level=tensor["kind"] == "none", streams=True, expert_streams=[True] * experts,
    )


norms = st.one_of(st.just(float("nan")), st.just(0.0), st.floats(0.0, 10.0, allow_nan=False))
betas = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.5, float("inf")]), st.floats(0.0, 3.0))


@st.composite
def bound_cases(draw, kinds):
    experts = draw(st.integers(1, 3))
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        blocks = draw(st.integers(1, 5))
        tensors.append({
            "kind": draw(st.sampled_from(kinds)),
            "l2": [draw(st.lists(norms, min_size=blocks, max_size=blocks)) for _ in range(experts)],
            "beta": draw(st.lists(betas, min_size=experts, max_size=experts)),
        })
    reads = {}
    for t, tensor in enumerate(tensors):
        for i in range(experts):
            picked = sorted(draw(st.sets(st.integers(0, len(tensor["l2"][0]) - 1))))
            if picked:
                reads.setdefault(t, {})[i] = picked
    return tensors, reads


def _check_bound(tensors, reads):
    plans = [_tensor_plan(t, tensor) for t, tensor in enumerate(tensors)]
    as_arrays = {t: {i: np.array(b, dtype=np.int64) for i, b in per.items()} for t, per in reads.items()}
    bound = error_bound(plans, as_arrays)
    expected, expected_kind = reference_bound(tensors, reads)
    assert bound.kind == expected_kind
    assert bound.value == expected  # same order of additions: the same bits (the bound promises it)
    assert bound.share == reference_share(tensors, reads)


@pytest.mark.parametrize("kind", BOUND_KINDS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_error_bound_equals_the_per_block_formula(kind, data):
    _check_bound(*data.draw(bound_cases([kind])))


@settings(max_examples=150, deadline=None)
@given(bound_cases(list(BOUND_KINDS)))
def test_error_bound_with_mixed_kinds(case):
    _check_bound(*case)


def test_error_bound_small_cases_by_hand():
    """Values worked out on paper, so a shared misreading of the formula shows."""
    def bound(tensor, reads):
        b = error_bound([_tensor_plan(0, tensor)], reads)
        return b.value, b.kind, round(b.share, 12)

    # exact: one expert, beta 2, blocks ||Δ|| 3 and 4, block 0 read -> 2*4 = 8; share sqrt(64 / 100) = 0.8
    exact = {"kind": "exact", "l2": [[3.0, 4.0]], "beta": [2.0]}
    assert bound(exact, {0: {0: np.array([0])}}) == (8.0, "bound", 0.8)
    # consensus: two experts on one block, expert 0 read (w 3), expert 1 omitted (w 4): 2 (3 + 4) = 14
    consensus = {"kind": "consensus", "l2": [[3.0], [4.0]], "beta": [1.0, 1.0]}
    assert bound(consensus, {0: {0: np.array([0])}}) == (14.0, "bound", 0.8)
    # ... the same with nothing read: reading part of a block never raises the bound
    assert bound(consensus, {}) == (14.0, "bound", 1.0)
    # ... and nothing omitted: 0
    assert bound(consensus, {0: {0: np.array([0]), 1: np.array([0])}}) == (0.0, "bound", 0.0)
    # none: beta inf counts as 1, the figure is an estimate: blocks 3 and 4 -> sqrt(3² + 4²) = 5 ...
    none = {"kind": "none", "l2": [[3.0, 4.0]], "beta": [math.inf]}
    assert bound(none, {}) == (5.0, "estimate", 1.0)
    # ... while two experts on one block add up before squaring: 3 + 4 = 7
    stacked = {"kind": "separable", "l2": [[3.0], [4.0]], "beta": [1.0, 1.0]}
    assert bound(stacked, {}) == (7.0, "bound", 1.0)
    # an unchanged (NaN) block never counts, read or not
    unchanged = {"kind": "exact", "l2": [[float("nan"), 4.0]], "beta": [1.0]}
    assert bound(unchanged, {0: {0: np.array([1])}}) == (0.0, "bound", 0.0)

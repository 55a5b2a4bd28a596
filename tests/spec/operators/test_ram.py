"""RAM and RAM+ tensor-local (mergepipe/spec/operators/ram.py): hand-computed merges, the epsilon
threshold, the gain's edge cases, what an unread expert means, and mergekit 0.1.5's own ``ram`` and
``ramplus_tl`` on random tensors.

The generic suite (test_kernels.py) checks both kernels against the plain-torch references of
their rows, and ``ram`` block by block; here each rule of the docstring is pinned on its own.
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.spec.operators.kernels import merge
from mergepipe.spec.operators import OPERATORS
from tests.spec.operators.table import context, make_inputs, params_for, run_blocks


def ram(name, base, deltas, ids=None, **global_):
    ids = ids or [f"e{i}" for i in range(len(deltas))]
    params = params_for(name, [{}] * len(deltas), global_, ids)
    return merge(base, deltas, context(name, tuple(base.shape), ids, params))


def test_definitions_take_mergekits_parameters_and_defaults():
    assert OPERATORS["ram"].global_params().to_dict() == {"epsilon": 1e-5}
    assert OPERATORS["ramplus_tl"].global_params().to_dict() == {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}
    assert OPERATORS["ram"].streaming and OPERATORS["ram"].error_bound == "consensus"
    assert not OPERATORS["ramplus_tl"].streaming and "whole tensors" in OPERATORS["ramplus_tl"].budget_note
    # DELLA keeps its own epsilon: a per-expert spread in [0, 0.5)
    (della,) = [d for d in OPERATORS["della"].expert_params.definitions() if d.name == "epsilon"]
    (mine,) = OPERATORS["ram"].global_params.definitions()
    assert (della.scope, OPERATORS["della"].expert_params().epsilon, della.bounds) == ("expert", 0.15, "[0, 0.5)")
    assert (mine.scope, OPERATORS["ram"].global_params().epsilon, mine.bounds) == ("global", 1e-5, "[0, inf]")


def test_ram_keeps_unique_changes_whole_and_averages_shared_ones():
    """Entry 0 both changed: their mean; 1 only expert 1 by more than epsilon; 2 both, cancelling; 3 nobody
    by more than epsilon (0.05 <= 0.1): the base."""
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    d1 = torch.tensor([0.5, -0.4, 0.3, 0.0])
    d2 = torch.tensor([0.2, 0.05, -0.3, 0.05])
    out = ram("ram", base, [d1, d2], epsilon=0.1)
    torch.testing.assert_close(out, torch.tensor([1.35, 1.6, 3.0, 4.0]), rtol=0, atol=1e-7)


def test_ramplus_scales_each_experts_unique_entries_by_its_own_gain():
    """Expert 1 changes entries 0, 1, 2 (0 shared): S = 1, U = 2, ρ = 0.5, λ = 1 + 0.1 · 0.5. Expert 2
    changes 0 and 3: S = 1, U = 1, ρ = 1 capped at α = 0.8, λ = 1.08."""
    d1 = torch.tensor([0.5, 0.25, -0.5, 0.0])
    d2 = torch.tensor([0.25, 0.0, 0.0, 1.0])
    out = ram("ramplus_tl", torch.zeros(4), [d1, d2], r=0.1, alpha=0.8, epsilon=1e-5)
    torch.testing.assert_close(out, torch.tensor([0.375, 0.25 * 1.05, -0.5 * 1.05, 1.08]), rtol=3e-7, atol=0)


def test_ramplus_gain_is_capped_and_an_unchanged_expert_is_harmless():
    """Expert 2 shares 2 entries and has 1 alone: ρ = 2, capped at α = 0.5. With epsilon 0 an expert that
    changes nothing has S = U = 0: ρ = 0 here (mergekit divides 0 by 0 there and writes NaN for the whole
    tensor); expert 2 then has every entry alone, S = 0, λ = 1."""
    d1 = torch.tensor([0.5, 0.5, 0.0])
    d2 = torch.tensor([0.5, -0.5, 1.0])
    out = ram("ramplus_tl", torch.zeros(3), [d1, d2], r=1.0, alpha=0.5, epsilon=1e-5)
    torch.testing.assert_close(out, torch.tensor([0.5, 0.0, 1.5]), rtol=0, atol=0)
    out = ram("ramplus_tl", torch.zeros(3), [d2, torch.zeros(3)], r=1.0, alpha=0.5, epsilon=0.0)
    assert torch.equal(out, d2)


@pytest.mark.parametrize("name", ["ram", "ramplus_tl"])
def test_an_unread_expert_takes_no_part(name):
    """None (not read under the budget) is merging without that expert, bit for bit: the definitions say
    absent_neutral, which lets an incremental merge keep blocks the expert never touched."""
    base, deltas = make_inputs((20, 12), 3, seed=6)
    with_none = ram(name, base, [deltas[0], None, deltas[2]], ids=["a", "b", "c"], epsilon=0.01)
    without = ram(name, base, [deltas[0], deltas[2]], ids=["a", "c"], epsilon=0.01)
    assert torch.equal(with_none, without)
    assert OPERATORS[name].absent_neutral(params_for(name, [{}] * 3, {}))


def test_ram_streams_block_by_block_with_unread_blocks():
    """An unread block of an expert: that block is merged from the other experts alone."""
    base, deltas = make_inputs((24, 7), 3, seed=2)
    params = params_for("ram", [{}] * 3, {"epsilon": 0.01}, ["a", "b", "c"])
    ctx = context("ram", (24, 7), ["a", "b", "c"], params)
    got = run_blocks(base, deltas, ctx, 8, unread=frozenset({(1, 1)}))
    rows = slice(8, 16)
    assert torch.equal(got[rows], ram("ram", base[rows], [deltas[0][rows], deltas[2][rows]], ids=["a", "c"],
                                      epsilon=0.01))
    assert torch.equal(got[:8], ram("ram", base[:8], [d[:8] for d in deltas], ids=["a", "b", "c"], epsilon=0.01))


# ------------------------------------------------------------------ mergekit


@pytest.mark.mergekit
@pytest.mark.parametrize("name, params", [
    ("ram", {}), ("ram", {"epsilon": 0.02}),
    ("ramplus_tl", {}), ("ramplus_tl", {"r": 0.5, "alpha": 3.0, "epsilon": 0.02}),
])
def test_mergekits_ram_methods_give_the_same_bits_with_experts_in_id_order(name, params):
    """mergekit's own kernels (its functional API) on the same tensors, experts listed in id order: the
    same bits for ram; ramplus_tl's gain is fp32 there, float64 here, so within fp32 rounding. Listed in
    another order, mergekit sums in that order: within rounding."""
    pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed")
    from mergekit.merge_methods.base import TensorGroup
    from mergekit.merge_methods.ram import ram_merge, ramplus_tl_merge

    method = {"ram": ram_merge, "ramplus_tl": ramplus_tl_merge}[name]
    for seed, shape in enumerate([(64, 48), (1000,), (33, 7, 5)]):
        base, deltas = make_inputs(shape, 3, seed=seed)
        for i, d in enumerate(deltas):  # sparse task vectors, as agents' fine-tunes are: unique entries abound
            d[torch.rand(shape, generator=torch.Generator().manual_seed(10 * seed + i)) < 0.5] = 0.0
        experts = [base + d for d in deltas]
        scale = torch.stack([base.abs(), *(e.abs() for e in experts)]).amax(dim=0)
        for order in ([0, 1, 2], [2, 0, 1]):
            group = TensorGroup.from_tensors([base, *(experts[i] for i in order)], base_index=0)
            (theirs,) = method([group], parameters=params)
            mine = ram(name, base, [e - base for e in experts], ids=["a", "b", "c"], **params)
            if name == "ram" and order == [0, 1, 2]:
                assert torch.equal(mine, theirs)
            assert bool(((mine - theirs).abs() <= scale * 2.0**-20).all())


@pytest.mark.mergekit
def test_mergekits_ramplus_writes_nan_where_epsilon_0_meets_an_unchanged_expert():
    """The one case that differs beyond rounding, documented in ram.py and docs/MERGEKIT.md."""
    pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed")
    from mergekit.merge_methods.base import TensorGroup
    from mergekit.merge_methods.ram import ramplus_tl_merge

    base, (d,) = make_inputs((8, 4), 1, seed=3)
    group = TensorGroup.from_tensors([base, base + d, base.clone()], base_index=0)
    (theirs,) = ramplus_tl_merge([group], parameters={"epsilon": 0.0})
    assert bool(torch.isnan(theirs).all())
    assert torch.equal(ram("ramplus_tl", base, [d, torch.zeros_like(d)], epsilon=0.0), base + d)

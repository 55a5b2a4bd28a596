"""SCE (mergepipe/spec/operators/sce.py): hand-computed merges, the variance selection's tie rule, what
an unread expert means, and mergekit 0.1.5's own ``sce`` on random tensors.

The generic suite (test_kernels.py) checks the kernel against the plain-torch reference of
its row in table.py; here each rule of the docstring is pinned on its own.
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.spec.operators.kernels import merge
from mergepipe.spec.operators.sce import variance_keep
from mergepipe.spec.operators import OPERATORS
from tests.spec.operators import reference as ref
from tests.spec.operators.table import context, make_inputs, params_for


def sce(base, deltas, select_topk=1.0, ids=None):
    ids = ids or [f"e{i}" for i in range(len(deltas))]
    params = params_for("sce", [{}] * len(deltas), {"select_topk": select_topk}, ids)
    return merge(base, deltas, context("sce", tuple(base.shape), ids, params))


def test_is_tensor_level_with_mergekits_default():
    definition = OPERATORS["sce"]
    assert not definition.streaming and definition.error_bound == "none"
    assert definition.global_params().to_dict() == {"select_topk": 1.0}
    assert "whole tensors" in definition.budget_note and "variance" in definition.budget_note


def test_weights_by_energy_and_the_sum_elects_the_sign():
    """w = mean Δ²: 5/2 and 2/2, so c = 5/7 and 2/7. Entry 0: both agree (+): (5/7·2 + 2/7·1) / 1.
    Entry 1: the sum is 0, + is elected, only expert 2 (+1) agrees: 1."""
    d1, d2 = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 1.0])
    out = sce(torch.zeros(2), [d1, d2])
    torch.testing.assert_close(out, torch.tensor([12 / 7, 1.0]), rtol=1e-6, atol=0)


def test_tiny_weights_become_equal_weights():
    """Σ w < 1e-6: every expert weighs 1/K; the agreeing ones are averaged."""
    d1, d2 = torch.tensor([2e-4, -1e-4, 3e-4]), torch.tensor([4e-4, 2e-4, -1e-4])
    out = sce(torch.zeros(3), [d1, d2])
    torch.testing.assert_close(out, torch.tensor([3e-4, 2e-4, 3e-4]), rtol=1e-6, atol=0)


def test_the_agreeing_weight_is_clamped_from_below_as_mergekit_does():
    """Entry 1 only the small expert changes: its weight c2 ≈ 1e-8 is below the clamp of 1e-6."""
    d1, d2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1e-4])
    c2 = (1e-8 / 2) / (0.5 + 1e-8 / 2)
    out = sce(torch.zeros(2), [d1, d2])
    torch.testing.assert_close(out, torch.tensor([1.0, c2 * 1e-4 / 1e-6]), rtol=1e-5, atol=0)


def test_selection_keeps_the_entries_of_largest_variance_ties_first_in_row_major_order():
    """Variances 1, 1, 1, 1, 0.25, 0 (five non-zero): select_topk 0.5 keeps int(2.5) = 2, the first two of
    the four tied at 1; the rest of both deltas is erased."""
    d1 = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 0.5, 0.0]])
    d2 = -d1
    out = sce(torch.zeros(2, 3), [d1, d2], select_topk=0.5)
    # kept entries: both experts there, +1 and -1, c = 1/2 each: the sum is 0, + wins, the positive one stays
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_selection_of_nothing_leaves_the_base():
    base, deltas = make_inputs((6, 5), 3, seed=1)
    assert torch.equal(sce(base, deltas, select_topk=0.0), base)
    # one expert: no variance anywhere, so nothing is selected below 1
    assert torch.equal(sce(base, deltas[:1], select_topk=0.9), base)
    assert torch.equal(sce(base, deltas[:1], select_topk=1.0), base + deltas[0])


def test_an_unread_expert_counts_as_zero_among_the_k():
    """A partial budget's unread expert: its zeros widen the variance (another selection than merging
    without it), it weighs 0 and never agrees, exactly as a delta of zeros."""
    base, deltas = make_inputs((12, 9), 3, seed=4, quantize=False)
    unread = sce(base, [deltas[0], deltas[1], None], select_topk=0.3)
    zeros = sce(base, [deltas[0], deltas[1], torch.zeros_like(deltas[2])], select_topk=0.3)
    without = sce(base, deltas[:2], select_topk=0.3)
    assert torch.equal(unread, zeros)
    assert not torch.equal(unread, without)
    torch.testing.assert_close(unread, ref.sce(base, [deltas[0], deltas[1], torch.zeros_like(deltas[2])], 0.3),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("select_topk", [1.0, 0.7, 0.25])
def test_reference_on_larger_tensors(select_topk):
    base, deltas = make_inputs((40, 30), 4, seed=9)
    torch.testing.assert_close(sce(base, deltas, select_topk), ref.sce(base, deltas, select_topk),
                               rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ mergekit


@pytest.mark.mergekit
@pytest.mark.parametrize("quantize", [False, True], ids=["fp32 deltas", "bf16 checkpoints"])
@pytest.mark.parametrize("select_topk", [1.0, 0.5, 0.1])
def test_mergekits_sce_agrees_to_rounding_where_it_selects_the_same_entries(select_topk, quantize):
    """mergekit's own kernel (its functional API, as its merges call it) on the same tensors. Its ``topk``
    keeps any of the entries whose variance ties at the cut (bf16 checkpoints tie often), ours the first:
    every entry selected differently must be such a tie, and where the selections agree the merges agree
    to fp32 rounding. (One entry more or less moves the experts' weights, so a tensor with a tie at the
    cut differs by a little almost everywhere.) Fractions are printed (``pytest -s``; docs/MERGEKIT.md)."""
    pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed")
    from mergekit.merge_methods.base import TensorGroup
    from mergekit.merge_methods.sce import sce_mask, sce_merge

    selected = differ = tensors = tied_tensors = 0
    for seed, shape in enumerate([(64, 48), (256, 16), (1000,), (33, 7, 5), (128, 64), (512,)]):
        base, deltas = make_inputs(shape, 3, seed=seed, quantize=quantize)
        experts = [base + d for d in deltas]
        group = TensorGroup.from_tensors([base, *experts], base_index=0)
        (theirs,) = sce_merge([group], parameters={"select_topk": select_topk})
        mine = sce(base, [e - base for e in experts], select_topk, ids=["a", "b", "c"])  # listed order = id order
        tensors += 1
        if select_topk < 1:
            stacked = torch.stack([e - base for e in experts])
            their_keep = sce_mask(stacked, select_topk) != 0
            my_keep = variance_keep([e - base for e in experts], select_topk)
            variance = ref.sce_variance([e - base for e in experts])
            cut = variance[my_keep].min()
            assert bool((variance[my_keep != their_keep] == cut).all()), "selected differently away from a tie"
            selected, differ = selected + int(my_keep.sum()), differ + int((my_keep != their_keep).sum()) // 2
            if not torch.equal(my_keep, their_keep):
                tied_tensors += 1
                continue
        scale = torch.stack([base.abs(), *(e.abs() for e in experts)]).amax(dim=0)
        assert bool(((mine - theirs).abs() <= scale * 2.0**-20).all())
    print(f"\n[mergekit] sce select_topk={select_topk} {'bf16' if quantize else 'fp32'}: {differ} of {selected} "
          f"selected entries differ (ties at the cut), in {tied_tensors} of {tensors} tensors")
    if not quantize:
        assert differ == 0

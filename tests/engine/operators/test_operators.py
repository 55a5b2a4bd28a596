"""Every operator against the independent references, block by block and whole."""

from __future__ import annotations

import math

import pytest
import torch

from mergepipe.engine.operators.registry import OPERATORS
from mergepipe.errors import EngineError
from tests.engine.operators import reference as ref
from tests.engine.operators.conftest import (
    IDS,
    SEED,
    STREAMING,
    TENSOR,
    context,
    make_inputs,
    resolved,
    run_blocks,
    thresholds_for,
)

SHAPES = [(29, 17), (40,), (5, 3, 4), (7, 1), (1, 50)]


def sorted_by_id(ids, *lists):
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    return [[lst[i] for i in order] for lst in (ids, *lists)]


def expected(name, base, deltas, ids, per_expert, global_):
    s_ids, s_deltas, s_params = sorted_by_id(ids, deltas, per_expert)
    return ref.reference_merge(name, base, s_deltas, s_ids, s_params, global_, SEED, TENSOR)


def assert_same(name, got, want):
    if OPERATORS[name].streaming:
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPERATORS))
def test_whole_tensor_matches_reference(name, shape):
    op = OPERATORS[name]
    spec, per_expert, global_ = resolved(name)
    k = len(per_expert)
    base, deltas = make_inputs(shape, k, seed=len(name))
    ids = IDS[:k]
    out = op.merge(base, deltas, context(name, shape, ids, per_expert, global_))
    assert out.dtype == torch.float32 and out.shape == base.shape
    assert_same(name, out, expected(name, base, deltas, ids, per_expert, global_))


@pytest.mark.parametrize("rows_per_block", [1, 3, 8])
@pytest.mark.parametrize("name", STREAMING)
def test_blockwise_equals_whole_reference_bit_for_bit(name, rows_per_block):
    op = OPERATORS[name]
    shape = (29, 17)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=7)
    ids = IDS[: len(per_expert)]
    thr = thresholds_for(op, deltas, per_expert)
    assert op.streams_with(per_expert, global_, True)
    ctx = context(name, shape, ids, per_expert, global_, thr)
    got = run_blocks(op, base, deltas, ctx, rows_per_block)
    assert torch.equal(got, expected(name, base, deltas, ids, per_expert, global_))


@pytest.mark.parametrize("name", STREAMING)
def test_thresholds_from_catalog_equal_tensor_level_fallback(name):
    op = OPERATORS[name]
    shape = (29, 17)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=3)
    ids = IDS[: len(per_expert)]
    with_thr = op.merge(base, deltas, context(name, shape, ids, per_expert, global_, thresholds_for(op, deltas, per_expert)))
    without = op.merge(base, deltas, context(name, shape, ids, per_expert, global_))
    assert torch.equal(with_thr, without)


@pytest.mark.parametrize("name", [n for n in STREAMING if any(OPERATORS[n].needs_thresholds(p) for p in resolved(n)[1])])
def test_missing_thresholds_on_a_block_is_an_engine_error(name):
    op = OPERATORS[name]
    shape = (29, 17)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert))
    assert not op.streams_with(per_expert, global_, False)
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    with pytest.raises(EngineError, match="whole tensor"):
        op.merge(base[:5], [d[:5] for d in deltas], ctx)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_unread_expert_equals_reference_with_zero_delta(name):
    op = OPERATORS[name]
    shape = (29, 17)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=11)
    ids = IDS[: len(per_expert)]
    ctx = context(name, shape, ids, per_expert, global_)
    missing = len(per_expert) - 1
    got = op.merge(base, [None if i == missing else d for i, d in enumerate(deltas)], ctx)
    zeroed = [torch.zeros_like(d) if i == missing else d for i, d in enumerate(deltas)]
    assert_same(name, got, expected(name, base, zeroed, ids, per_expert, global_))


@pytest.mark.parametrize("name", STREAMING)
def test_unread_block_contributes_zero(name):
    """One unread block of one expert: the expert's sparsified delta (thresholds
    and ranks of the real tensor, from the catalog) is 0 on that block."""
    op = OPERATORS[name]
    shape = (29, 17)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=5)
    ids = IDS[: len(per_expert)]
    ctx = context(name, shape, ids, per_expert, global_, thresholds_for(op, deltas, per_expert))
    got = run_blocks(op, base, deltas, ctx, 8, unread={(0, 1), (2, 3)})
    s_ids, s_deltas, s_params, s_index = sorted_by_id(ids, deltas, per_expert, list(range(len(ids))))
    xs = [x.clone() for x in ref.sparsify_all(name, s_deltas, s_ids, s_params, global_, SEED, TENSOR)]
    for x, i in zip(xs, s_index):
        if i == 0:
            x[8:16] = 0
        if i == 2:
            x[24:32] = 0
    assert torch.equal(got, ref.combine(name, base, xs, s_params, global_))


@pytest.mark.parametrize("name", list(OPERATORS))
def test_result_does_not_depend_on_expert_order_or_run(name):
    op = OPERATORS[name]
    shape = (29, 17)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=2)
    ids = IDS[: len(per_expert)]
    first = op.merge(base, deltas, context(name, shape, ids, per_expert, global_))
    again = op.merge(base, deltas, context(name, shape, ids, per_expert, global_))
    perm = list(reversed(range(len(ids))))
    permuted = op.merge(
        base,
        [deltas[i] for i in perm],
        context(name, shape, [ids[i] for i in perm], [per_expert[i] for i in perm], global_),
    )
    assert torch.equal(first, again)
    assert torch.equal(first, permuted)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_all_zero_deltas_give_the_base(name):
    op = OPERATORS[name]
    shape = (12, 5)
    spec, per_expert, global_ = resolved(name)
    base, _ = make_inputs(shape, 0)
    zeros = [torch.zeros(shape) for _ in per_expert]
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    if name == "linear":  # weights sum to 2.0 but normalize: the base stands
        assert global_["normalize"]
    assert torch.equal(op.merge(base, zeros, ctx), base)
    assert torch.equal(op.merge(base, [None] * len(zeros), ctx), base)


@pytest.mark.parametrize("where", ["base", "delta"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", list(OPERATORS))
def test_nan_or_inf_input_is_an_engine_error(name, bad, where):
    op = OPERATORS[name]
    shape = (6, 4)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert))
    target = base if where == "base" else deltas[-1]
    target[3, 2] = bad
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    with pytest.raises(EngineError, match="NaN or Inf"):
        op.merge(base, deltas, ctx)


def test_sum_overflow_alone_is_not_an_error():
    op = OPERATORS["task_arithmetic"]
    spec, per_expert, global_ = resolved("task_arithmetic")
    base = torch.full((4, 4), 3e38)
    deltas = [torch.zeros(4, 4) for _ in per_expert]
    ctx = context("task_arithmetic", (4, 4), IDS, per_expert, global_)
    assert torch.equal(op.merge(base, deltas, ctx), base)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_single_expert(name):
    op = OPERATORS[name]
    if op.min_experts > 1:
        pytest.skip("needs at least two experts")
    shape = (9, 6)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, 1, seed=4)
    out = op.merge(base, deltas[:1], context(name, shape, IDS[:1], per_expert[:1], global_))
    assert_same(name, out, expected(name, base, deltas[:1], IDS[:1], per_expert[:1], global_))


@pytest.mark.parametrize("name", ["ties", "dare_ties", "breadcrumbs_ties", "della"])
def test_single_expert_consensus_is_lambda_times_sparsified_delta(name):
    op = OPERATORS[name]
    shape = (9, 6)
    spec, per_expert, global_ = resolved(name)
    global_ = {**global_, "normalize": True, "lambda": 0.5}
    base, deltas = make_inputs(shape, 1, seed=4)
    out = op.merge(base, deltas[:1], context(name, shape, IDS[:1], per_expert[:1], global_))
    (x,) = ref.sparsify_all(name, deltas[:1], IDS[:1], per_expert[:1], global_, SEED, TENSOR)
    torch.testing.assert_close(out, base + x * 0.5, rtol=0, atol=1e-7)


def test_exact_sign_tie_elects_plus():
    op = OPERATORS["ties"]
    shape = (3, 2)
    base = torch.zeros(shape)
    d = torch.tensor([[0.5, -0.25], [1.0, 0.0], [-2.0, 3.0]])
    per_expert = [{"weight": 1.0, "density": 1.0}, {"weight": 1.0, "density": 1.0}]
    global_ = {"lambda": 1.0, "normalize": True}
    out = op.merge(base, [d, -d], context("ties", shape, ["a", "b"], per_expert, global_))
    # the sum is 0 everywhere: + is elected, the positive entry of the two survives
    assert torch.equal(out, d.abs())


def test_ties_density_one_is_disjoint_mean_without_trimming():
    op = OPERATORS["ties"]
    shape = (4, 3)
    base, deltas = make_inputs(shape, 2, seed=9)
    per_expert = [{"weight": 1.0, "density": 1.0}] * 2
    global_ = {"lambda": 1.0, "normalize": True}
    assert op.needs_thresholds(per_expert[0]) == []
    out = op.merge(base, deltas, context("ties", shape, ["a", "b"], per_expert, global_))
    assert torch.equal(out, ref.consensus_combine(base, [1.0, 1.0], deltas, True, 1.0))


def test_ties_keeps_the_first_of_tied_entries():
    op = OPERATORS["ties"]
    d = torch.tensor([[0.1, 0.3, 0.3], [0.3, 0.2, 0.3]])  # k = int(0.5 * 6) = 3
    per_expert = [{"weight": 1.0, "density": 0.5}]
    global_ = {"lambda": 1.0, "normalize": True}
    ctx = context("ties", d.shape, ["a"], per_expert, global_)
    out = op.merge(torch.zeros(2, 3), [d], ctx)
    assert torch.equal(out, torch.tensor([[0.0, 0.3, 0.3], [0.3, 0.0, 0.0]]))
    # the same, one row at a time, with the catalog's threshold
    ctx = context("ties", d.shape, ["a"], per_expert, global_, thresholds_for(op, [d], per_expert))
    rows = torch.cat([op.merge(torch.zeros(1, 3), [d[r : r + 1]], ctx.for_rows(r)) for r in range(2)])
    assert torch.equal(rows, out)


def test_breadcrumbs_top_count_zero_drops_nothing_at_the_top():
    """mergekit < 0.1 sliced [n_bot:-0] here and dropped every entry."""
    op = OPERATORS["breadcrumbs"]
    d = torch.arange(1.0, 21.0)  # n = 20, gamma 0.01 -> int(0.2) = 0 at the top
    per_expert = [{"weight": 1.0, "density": 0.5, "gamma": 0.01}]
    global_ = {"lambda": 1.0, "normalize": False}
    out = op.merge(torch.zeros(20), [d], context("breadcrumbs", (20,), ["a"], per_expert, global_))
    # band [0, int(0.51 * 20) = 10): the 10 largest survive
    assert torch.equal(out, torch.where(d > 10, d, 0.0))


def test_breadcrumbs_drops_the_top_band():
    op = OPERATORS["breadcrumbs"]
    d = -torch.arange(1.0, 21.0)
    per_expert = [{"weight": 1.0, "density": 0.5, "gamma": 0.1}]
    global_ = {"lambda": 1.0, "normalize": False}
    out = op.merge(torch.zeros(20), [d], context("breadcrumbs", (20,), ["a"], per_expert, global_))
    # top 2 (|d| = 20, 19) dropped, next 10 kept, rest dropped
    assert torch.equal(out, torch.where((d.abs() <= 18) & (d.abs() > 8), d, 0.0))


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_random_mask_does_not_depend_on_block_size(name):
    op = OPERATORS[name]
    shape = (64, 31)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=21)
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    outs = [run_blocks(op, base, deltas, ctx, rpb) for rpb in (1, 5, 16, 64)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_dare_keeps_about_density_and_preserves_the_mean():
    op = OPERATORS["dare_linear"]
    shape = (256, 256)
    base = torch.zeros(shape)
    delta = torch.full(shape, 0.01)
    per_expert = [{"weight": 1.0, "density": 0.3}]
    global_ = {"lambda": 1.0, "normalize": False, "rescale": "inverse"}
    out = op.merge(base, [delta], context("dare_linear", shape, ["a"], per_expert, global_))
    kept = (out != 0).float().mean().item()
    assert abs(kept - 0.3) < 0.01
    assert abs(out.mean().item() - 0.01) < 0.0005


@pytest.mark.parametrize("name", ["dare_linear", "della_linear"])
def test_l1_rescale_matches_the_l1_norm_and_is_tensor_level(name):
    op = OPERATORS[name]
    shape = (32, 16)
    spec, per_expert, global_ = resolved(name)
    global_ = {**global_, "rescale": "l1", "lambda": 1.0, "normalize": False}
    per_expert = [{**per_expert[0], "weight": 1.0}]
    assert not op.streams_with(per_expert, global_, True)
    base, deltas = make_inputs(shape, 1, seed=8)
    out = op.merge(base, deltas[:1], context(name, shape, IDS[:1], per_expert, global_))
    got = (out - base).abs().double().sum().item()
    assert abs(got - deltas[0].abs().double().sum().item()) < 1e-3 * got
    assert_same(name, out, expected(name, base, deltas[:1], IDS[:1], per_expert, global_))


def test_della_keep_probability_grows_with_magnitude():
    op = OPERATORS["della_linear"]
    shape = (2000, 10)
    base = torch.zeros(shape)
    delta = torch.arange(1.0, 11.0).repeat(2000, 1)  # rank 0..9 in every row
    per_expert = [{"weight": 1.0, "density": 0.5, "epsilon": 0.3}]
    global_ = {"lambda": 1.0, "normalize": False, "rescale": "none"}
    out = op.merge(base, [delta], context("della_linear", shape, ["a"], per_expert, global_))
    kept = (out != 0).float().mean(dim=0)
    want = 0.2 + 0.6 * torch.arange(10) / 9
    assert (kept - want).abs().max() < 0.05


@pytest.mark.parametrize("name", ["avg", "linear", "task_arithmetic"])
def test_fixed_coefficient_is_the_exact_effect_of_an_expert(name):
    op = OPERATORS[name]
    assert op.fixed_coefficient and op.error_bound == "exact"
    shape = (10, 4)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=1)
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    coef = op.coefficient(per_expert, global_)
    full = op.merge(base, deltas, ctx)
    for i in range(len(deltas)):
        without = op.merge(base, [None if j == i else d for j, d in enumerate(deltas)], ctx)
        torch.testing.assert_close(full - without, deltas[i] * coef[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in STREAMING if OPERATORS[n].error_bound == "separable"])
def test_separable_bound_holds_per_expert(name):
    op = OPERATORS[name]
    shape = (20, 8)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=6)
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    beta = op.coefficient(per_expert, global_)
    full = op.merge(base, deltas, ctx)
    for i in range(len(deltas)):
        without = op.merge(base, [None if j == i else d for j, d in enumerate(deltas)], ctx)
        assert ((full - without).abs() <= beta[i] * deltas[i].abs() * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("name", [n for n in STREAMING if OPERATORS[n].error_bound == "consensus"])
def test_consensus_bound_holds_on_the_merged_delta(name):
    op = OPERATORS[name]
    shape = (20, 8)
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=6)
    ctx = context(name, shape, IDS[: len(per_expert)], per_expert, global_)
    beta = op.coefficient(per_expert, global_)
    merged = op.merge(base, deltas, ctx) - base
    bound = sum(b * d.abs() for b, d in zip(beta, deltas))
    assert (merged.abs() <= bound * (1 + 1e-5) + 1e-6).all()


def test_tensor_level_operators_refuse_blocks():
    op = OPERATORS["slerp"]
    spec, per_expert, global_ = resolved("slerp")
    base, deltas = make_inputs((8, 4), 1)
    ctx = context("slerp", (8, 4), IDS[:1], per_expert, global_)
    assert not op.streams_with(per_expert, global_, True)
    with pytest.raises(ValueError, match="tensor-level"):
        op.merge(base[:4], [deltas[0][:4]], ctx)


def test_slerp_endpoints_and_colinear_fallback():
    op = OPERATORS["slerp"]
    base, deltas = make_inputs((8, 4), 1, scale=0.5, quantize=False)
    for t, want in [(0.0, base), (1.0, base + deltas[0])]:
        out = op.merge(base, deltas, context("slerp", (8, 4), ["a"], [{}], {"t": t}))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # a delta along the base is colinear: lerp
    out = op.merge(base, [base * 0.1], context("slerp", (8, 4), ["a"], [{}], {"t": 0.25}))
    assert torch.equal(out, base + (base * 0.1) * 0.25)


def test_model_stock_identical_deltas_take_the_full_step():
    op = OPERATORS["model_stock"]
    base, deltas = make_inputs((8, 4), 1, quantize=False)
    out = op.merge(base, [deltas[0], deltas[0].clone()], context("model_stock", (8, 4), ["a", "b"], [{}, {}], {}))
    torch.testing.assert_close(out, base + deltas[0])  # cos = 1 -> t = 1


@pytest.mark.parametrize("name", ["task_arithmetic", "linear"])
def test_overflow_in_the_merge_is_an_engine_error(name):
    op = OPERATORS[name]
    per_expert = [{"weight": 1.0}, {"weight": 1.0}]
    global_ = {"lambda": 1.0, "normalize": False}
    if name == "linear":
        global_ = {"normalize": False}
    base = torch.full((2, 2), 3e38)
    ctx = context(name, (2, 2), ["a", "b"], per_expert, global_)
    with pytest.raises(EngineError, match="overflowed"):
        op.merge(base, [torch.full((2, 2), 3e38), torch.full((2, 2), 3e38)], ctx)


@pytest.mark.parametrize("shape", [(0, 5), (0,), ()], ids=str)
@pytest.mark.parametrize("name", list(OPERATORS))
def test_empty_and_scalar_tensors(name, shape):
    op = OPERATORS[name]
    spec, per_expert, global_ = resolved(name)
    base, deltas = make_inputs(shape, len(per_expert), seed=1)
    ids = IDS[: len(per_expert)]
    out = op.merge(base, deltas, context(name, shape, ids, per_expert, global_))
    assert out.shape == base.shape
    if base.numel():
        assert_same(name, out, expected(name, base, deltas, ids, per_expert, global_))

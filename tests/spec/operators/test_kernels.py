"""Every kernel against its row's independent reference (``table.py``), block by block and whole.

Kernels are reached the way the engine reaches them: ``kernels.merge`` with a ``BlockContext`` built
from the definition's typed params.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mergepipe.spec.operators.kernels import merge, sign_consensus
from mergepipe.errors import ConfigError, EngineError
from mergepipe.spec.operators.base import TensorParams
from mergepipe.spec.operators import OPERATORS
from tests.spec.operators import reference as ref
from tests.spec.operators.table import (
    CASES,
    IDS,
    STREAMING,
    TABLE,
    TENSOR,
    as_dicts,
    context,
    make_inputs,
    params_for,
    reference_merge,
    resolved,
    run_blocks,
    sparsify_all,
    thresholds_for,
)

SHAPES = [(29, 17), (40,), (5, 3, 4), (7, 1), (1, 50)]


def sorted_by_id(ids, *lists):
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    return [[lst[i] for i in order] for lst in (ids, *lists)]


def expected(name, base, deltas, ids, params: TensorParams):
    """The reference result, with experts in id order (the kernels' summation order)."""
    per_expert, global_ = as_dicts(params)
    s_ids, s_deltas, s_params = sorted_by_id(ids, deltas, per_expert)
    return reference_merge(name, base, s_deltas, s_ids, s_params, global_)


def assert_same(name, got, want):
    """Bit for bit for streaming operators; float64 reductions of the
    tensor-level ones may differ in their last bits."""
    if OPERATORS[name].streaming:
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def first_experts(params: TensorParams, k: int) -> TensorParams:
    return TensorParams(params.experts[:k], params.global_)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPERATORS))
def test_whole_tensor_matches_reference(name, shape):
    params = resolved(name)
    k = len(params.experts)
    base, deltas = make_inputs(shape, k, seed=len(name))
    ids = IDS[:k]
    out = merge(base, deltas, context(name, shape, ids, params))
    assert out.dtype == torch.float32 and out.shape == base.shape
    assert_same(name, out, expected(name, base, deltas, ids, params))


@pytest.mark.parametrize("rows_per_block", [1, 3, 8])
@pytest.mark.parametrize("name", STREAMING)
def test_blockwise_equals_whole_reference_bit_for_bit(name, rows_per_block):
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=7)
    ids = IDS[: len(params.experts)]
    thr = thresholds_for(name, deltas, params)
    assert OPERATORS[name].streams_with(params, True)
    ctx = context(name, shape, ids, params, thr)
    got = run_blocks(base, deltas, ctx, rows_per_block)
    assert torch.equal(got, expected(name, base, deltas, ids, params))


@pytest.mark.parametrize("name", STREAMING)
def test_thresholds_from_catalog_equal_tensor_level_fallback(name):
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=3)
    ids = IDS[: len(params.experts)]
    with_thr = merge(base, deltas, context(name, shape, ids, params, thresholds_for(name, deltas, params)))
    without = merge(base, deltas, context(name, shape, ids, params))
    assert torch.equal(with_thr, without)


NEED_THRESHOLDS = [n for n in STREAMING if any(OPERATORS[n].needs_thresholds(p) for p in resolved(n).experts)]


def test_the_threshold_operators_are_the_magnitude_trims():
    """Guards the parametrization below against silently shrinking."""
    assert NEED_THRESHOLDS == ["breadcrumbs", "breadcrumbs_ties", "ties"]


@pytest.mark.parametrize("name", NEED_THRESHOLDS)
def test_missing_thresholds_on_a_block_is_an_engine_error(name):
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts))
    assert not OPERATORS[name].streams_with(params, False)
    ctx = context(name, shape, IDS[: len(params.experts)], params)
    with pytest.raises(EngineError, match="whole tensor"):
        merge(base[:5], [d[:5] for d in deltas], ctx)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_unread_expert_equals_reference_with_zero_delta(name):
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=11)
    ids = IDS[: len(params.experts)]
    ctx = context(name, shape, ids, params)
    missing = len(params.experts) - 1
    got = merge(base, [None if i == missing else d for i, d in enumerate(deltas)], ctx)
    zeroed = [torch.zeros_like(d) if i == missing else d for i, d in enumerate(deltas)]
    assert_same(name, got, expected(name, base, zeroed, ids, params))


@pytest.mark.parametrize("name", STREAMING)
def test_unread_block_contributes_zero(name):
    """One unread block of one expert: the expert's sparsified delta (thresholds
    and ranks of the real tensor, from the catalog) is 0 on that block."""
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=5)
    ids = IDS[: len(params.experts)]
    ctx = context(name, shape, ids, params, thresholds_for(name, deltas, params))
    got = run_blocks(base, deltas, ctx, 8, unread=frozenset({(0, 1), (2, 3)}))
    per_expert, global_ = as_dicts(params)
    s_ids, s_deltas, s_params, s_index = sorted_by_id(ids, deltas, per_expert, list(range(len(ids))))
    xs = [x.clone() for x in sparsify_all(name, s_deltas, s_ids, s_params, global_)]
    for x, i in zip(xs, s_index):
        if i == 0:
            x[8:16] = 0
        if i == 2:
            x[24:32] = 0
    assert torch.equal(got, TABLE[name].combine(base, xs, s_params, global_))


@pytest.mark.parametrize("name", list(OPERATORS))
def test_result_does_not_depend_on_expert_order_or_run(name):
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=2)
    ids = IDS[: len(params.experts)]
    first = merge(base, deltas, context(name, shape, ids, params))
    again = merge(base, deltas, context(name, shape, ids, params))
    perm = list(reversed(range(len(ids))))
    permuted_params = TensorParams(tuple(params.experts[i] for i in perm), params.global_)
    permuted = merge(base, [deltas[i] for i in perm], context(name, shape, [ids[i] for i in perm], permuted_params))
    assert torch.equal(first, again)
    assert torch.equal(first, permuted)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_all_zero_deltas_give_the_base(name):
    shape = (12, 5)
    params = resolved(name)
    base, _ = make_inputs(shape, 0)
    zeros = [torch.zeros(shape) for _ in params.experts]
    ctx = context(name, shape, IDS[: len(params.experts)], params)
    if name == "linear":  # weights sum to 2.0 but normalize: the base stands
        assert params.global_.normalize
    assert torch.equal(merge(base, zeros, ctx), base)
    assert torch.equal(merge(base, [None] * len(zeros), ctx), base)


@pytest.mark.parametrize("owned", [False, True], ids=["caller's deltas", "engine's deltas"])
@pytest.mark.parametrize("where", ["base", "delta"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", list(OPERATORS))
def test_nan_or_inf_input_is_an_engine_error(name, bad, where, owned):
    """The error names the input that holds it, also when the kernel was
    allowed to overwrite the deltas."""
    shape = (6, 4)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts))
    target = base if where == "base" else deltas[-1]
    target[3, 2] = bad
    ids = IDS[: len(params.experts)]
    ctx = replace(context(name, shape, ids, params), owns_deltas=owned)
    culprit = "the base" if where == "base" else f"expert {ids[-1]!r}"
    with pytest.raises(EngineError, match=f"NaN or Inf.*{culprit}|{culprit}.*NaN or Inf"):
        merge(base, deltas, ctx)


@pytest.mark.parametrize("rows_per_block", [None, 5])
@pytest.mark.parametrize("name", list(OPERATORS))
def test_kernels_that_own_their_deltas_give_the_same_bits(name, rows_per_block):
    """``owns_deltas`` (the engine's contexts) only changes where results are
    written: the same bits as a kernel that leaves the deltas alone."""
    shape = (29, 17)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=8)
    ids = IDS[: len(params.experts)]
    ctx = context(name, shape, ids, params, thresholds_for(name, deltas, params))
    owning = replace(ctx, owns_deltas=True)
    if rows_per_block is None or not OPERATORS[name].streaming:
        want, got = merge(base, deltas, ctx), merge(base, [d.clone() for d in deltas], owning)
    else:
        want = run_blocks(base, deltas, ctx, rows_per_block)
        got = run_blocks(base, [d.clone() for d in deltas], owning, rows_per_block)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_sum_overflow_alone_is_not_an_error():
    params = resolved("task_arithmetic")
    base = torch.full((4, 4), 3e38)
    deltas = [torch.zeros(4, 4) for _ in params.experts]
    ctx = context("task_arithmetic", (4, 4), IDS, params)
    assert torch.equal(merge(base, deltas, ctx), base)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_single_expert(name):
    if OPERATORS[name].min_experts > 1:
        pytest.skip("needs at least two experts")
    shape = (9, 6)
    per_expert, global_ = CASES[name]
    params = params_for(name, per_expert[:1], global_)
    try:
        OPERATORS[name].check_tensor(params, TENSOR)
    except ConfigError:
        pytest.skip("one expert is not a merge of this configuration (nuslerp: two task vectors)")
    base, deltas = make_inputs(shape, 1, seed=4)
    out = merge(base, deltas[:1], context(name, shape, IDS[:1], params))
    assert_same(name, out, expected(name, base, deltas[:1], IDS[:1], params))


@pytest.mark.parametrize("name", ["ties", "dare_ties", "breadcrumbs_ties", "della"])
def test_single_expert_consensus_is_lambda_times_sparsified_delta(name):
    shape = (9, 6)
    per_expert, global_ = CASES[name]
    params = params_for(name, per_expert[:1], {**global_, "normalize": True, "lambda": 0.5})
    base, deltas = make_inputs(shape, 1, seed=4)
    out = merge(base, deltas[:1], context(name, shape, IDS[:1], params))
    experts, g = as_dicts(params)
    (x,) = sparsify_all(name, deltas[:1], IDS[:1], experts, g)
    torch.testing.assert_close(out, base + x * 0.5, rtol=0, atol=1e-7)


def test_exact_sign_tie_elects_plus():
    shape = (3, 2)
    base = torch.zeros(shape)
    d = torch.tensor([[0.5, -0.25], [1.0, 0.0], [-2.0, 3.0]])
    params = params_for("ties", [{"weight": 1.0, "density": 1.0}] * 2, {"lambda": 1.0, "normalize": True}, ["a", "b"])
    out = merge(base, [d, -d], context("ties", shape, ["a", "b"], params))
    # the sum is 0 everywhere: + is elected, the positive entry of the two survives
    assert torch.equal(out, d.abs())


def test_ties_density_one_is_disjoint_mean_without_trimming():
    shape = (4, 3)
    base, deltas = make_inputs(shape, 2, seed=9)
    params = params_for("ties", [{"weight": 1.0, "density": 1.0}] * 2, {"lambda": 1.0, "normalize": True}, ["a", "b"])
    assert OPERATORS["ties"].needs_thresholds(params.experts[0]) == ()
    out = merge(base, deltas, context("ties", shape, ["a", "b"], params))
    assert torch.equal(out, ref.consensus_combine(base, [1.0, 1.0], deltas, True, 1.0))


def test_ties_keeps_the_first_of_tied_entries():
    d = torch.tensor([[0.1, 0.3, 0.3], [0.3, 0.2, 0.3]])  # k = int(0.5 * 6) = 3
    params = params_for("ties", [{"weight": 1.0, "density": 0.5}], {"lambda": 1.0, "normalize": True}, ["a"])
    ctx = context("ties", d.shape, ["a"], params)
    out = merge(torch.zeros(2, 3), [d], ctx)
    assert torch.equal(out, torch.tensor([[0.0, 0.3, 0.3], [0.3, 0.0, 0.0]]))
    # the same, one row at a time, with the catalog's threshold
    ctx = context("ties", d.shape, ["a"], params, thresholds_for("ties", [d], params))
    rows = torch.cat([merge(torch.zeros(1, 3), [d[r : r + 1]], ctx.for_rows(r)) for r in range(2)])
    assert torch.equal(rows, out)


def test_breadcrumbs_top_count_zero_drops_nothing_at_the_top():
    """mergekit < 0.1 sliced [n_bot:-0] here and dropped every entry."""
    d = torch.arange(1.0, 21.0)  # n = 20, gamma 0.01 -> int(0.2) = 0 at the top
    params = params_for("breadcrumbs", [{"weight": 1.0, "density": 0.5, "gamma": 0.01}],
                        {"lambda": 1.0, "normalize": False}, ["a"])
    out = merge(torch.zeros(20), [d], context("breadcrumbs", (20,), ["a"], params))
    # band [0, int(0.51 * 20) = 10): the 10 largest survive
    assert torch.equal(out, torch.where(d > 10, d, 0.0))


def test_breadcrumbs_drops_the_top_band():
    d = -torch.arange(1.0, 21.0)
    params = params_for("breadcrumbs", [{"weight": 1.0, "density": 0.5, "gamma": 0.1}],
                        {"lambda": 1.0, "normalize": False}, ["a"])
    out = merge(torch.zeros(20), [d], context("breadcrumbs", (20,), ["a"], params))
    # top 2 (|d| = 20, 19) dropped, next 10 kept, rest dropped
    assert torch.equal(out, torch.where((d.abs() <= 18) & (d.abs() > 8), d, 0.0))


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_random_mask_does_not_depend_on_block_size(name):
    shape = (64, 31)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=21)
    ctx = context(name, shape, IDS[: len(params.experts)], params)
    outs = [run_blocks(base, deltas, ctx, rpb) for rpb in (1, 5, 16, 64)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_dare_keeps_about_density_and_preserves_the_mean():
    shape = (256, 256)
    base = torch.zeros(shape)
    delta = torch.full(shape, 0.01)
    params = params_for("dare_linear", [{"weight": 1.0, "density": 0.3}],
                        {"lambda": 1.0, "normalize": False, "rescale": "inverse"}, ["a"])
    out = merge(base, [delta], context("dare_linear", shape, ["a"], params))
    kept = (out != 0).float().mean().item()
    assert abs(kept - 0.3) < 0.01
    assert abs(out.mean().item() - 0.01) < 0.0005


@pytest.mark.parametrize("name", ["dare_linear", "della_linear"])
def test_l1_rescale_matches_the_l1_norm_and_is_tensor_level(name):
    shape = (32, 16)
    per_expert, global_ = CASES[name]
    params = params_for(name, [{**per_expert[0], "weight": 1.0}],
                        {**global_, "rescale": "l1", "lambda": 1.0, "normalize": False})
    assert not OPERATORS[name].streams_with(params, True)
    base, deltas = make_inputs(shape, 1, seed=8)
    out = merge(base, deltas[:1], context(name, shape, IDS[:1], params))
    got = (out - base).abs().double().sum().item()
    assert abs(got - deltas[0].abs().double().sum().item()) < 1e-3 * got
    assert_same(name, out, expected(name, base, deltas[:1], IDS[:1], params))


def test_della_keep_probability_grows_with_magnitude():
    shape = (2000, 10)
    base = torch.zeros(shape)
    delta = torch.arange(1.0, 11.0).repeat(2000, 1)  # rank 0..9 in every row
    params = params_for("della_linear", [{"weight": 1.0, "density": 0.5, "epsilon": 0.3}],
                        {"lambda": 1.0, "normalize": False, "rescale": "none"}, ["a"])
    out = merge(base, [delta], context("della_linear", shape, ["a"], params))
    kept = (out != 0).float().mean(dim=0)
    want = 0.2 + 0.6 * torch.arange(10) / 9
    assert (kept - want).abs().max() < 0.05


@pytest.mark.parametrize("name", [n for n, d in OPERATORS.items() if d.error_bound == "exact"])
def test_exact_coefficients_are_the_exact_effect_of_an_expert(name):
    definition = OPERATORS[name]
    assert name in ("avg", "linear", "task_arithmetic")
    shape = (10, 4)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=1)
    ctx = context(name, shape, IDS[: len(params.experts)], params)
    coef = definition.coefficients(params)
    assert definition.beta(params) == [abs(c) for c in coef]
    full = merge(base, deltas, ctx)
    for i in range(len(deltas)):
        without = merge(base, [None if j == i else d for j, d in enumerate(deltas)], ctx)
        torch.testing.assert_close(full - without, deltas[i] * coef[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in STREAMING if OPERATORS[n].error_bound == "separable"])
def test_separable_bound_holds_per_expert(name):
    shape = (20, 8)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=6)
    ctx = context(name, shape, IDS[: len(params.experts)], params)
    beta = OPERATORS[name].beta(params)
    full = merge(base, deltas, ctx)
    for i in range(len(deltas)):
        without = merge(base, [None if j == i else d for j, d in enumerate(deltas)], ctx)
        assert ((full - without).abs() <= beta[i] * deltas[i].abs() * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("name", [n for n in STREAMING if OPERATORS[n].error_bound == "consensus"])
def test_consensus_bound_holds_on_the_merged_delta(name):
    shape = (20, 8)
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=6)
    ctx = context(name, shape, IDS[: len(params.experts)], params)
    beta = OPERATORS[name].beta(params)
    merged = merge(base, deltas, ctx) - base
    bound = sum(b * d.abs() for b, d in zip(beta, deltas))
    assert (merged.abs() <= bound * (1 + 1e-5) + 1e-6).all()


def test_tensor_level_operators_refuse_blocks():
    params = resolved("slerp")
    base, deltas = make_inputs((8, 4), 1)
    ctx = context("slerp", (8, 4), IDS[:1], params)
    assert not OPERATORS["slerp"].streams_with(params, True)
    with pytest.raises(ValueError, match="tensor-level"):
        merge(base[:4], [deltas[0][:4]], ctx)


def test_slerp_endpoints_and_colinear_fallback():
    base, deltas = make_inputs((8, 4), 1, scale=0.5, quantize=False)
    for t, want in [(0.0, base), (1.0, base + deltas[0])]:
        out = merge(base, deltas, context("slerp", (8, 4), ["a"], params_for("slerp", [{}], {"t": t}, ["a"])))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # a delta along the base is colinear: lerp
    ctx = context("slerp", (8, 4), ["a"], params_for("slerp", [{}], {"t": 0.25}, ["a"]))
    out = merge(base, [base * 0.1], ctx)
    assert torch.equal(out, base + (base * 0.1) * 0.25)


def test_model_stock_identical_deltas_take_the_full_step():
    base, deltas = make_inputs((8, 4), 1, quantize=False)
    ctx = context("model_stock", (8, 4), ["a", "b"], params_for("model_stock", [{}, {}], {}, ["a", "b"]))
    out = merge(base, [deltas[0], deltas[0].clone()], ctx)
    torch.testing.assert_close(out, base + deltas[0])  # cos = 1 -> t = 1


@pytest.mark.parametrize("name", ["task_arithmetic", "linear"])
def test_overflow_in_the_merge_is_an_engine_error(name):
    global_ = {"normalize": False} if name == "linear" else {"lambda": 1.0, "normalize": False}
    params = params_for(name, [{"weight": 1.0}, {"weight": 1.0}], global_, ["a", "b"])
    base = torch.full((2, 2), 3e38)
    ctx = context(name, (2, 2), ["a", "b"], params)
    with pytest.raises(EngineError, match="overflowed"):
        merge(base, [torch.full((2, 2), 3e38), torch.full((2, 2), 3e38)], ctx)


@pytest.mark.parametrize("shape", [(0, 5), (0,), ()], ids=str)
@pytest.mark.parametrize("name", list(OPERATORS))
def test_empty_and_scalar_tensors(name, shape):
    params = resolved(name)
    base, deltas = make_inputs(shape, len(params.experts), seed=1)
    ids = IDS[: len(params.experts)]
    out = merge(base, deltas, context(name, shape, ids, params))
    assert out.shape == base.shape
    if base.numel():
        assert_same(name, out, expected(name, base, deltas, ids, params))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 0.0, 2.5], [1e-40, 1.0, 1.0, 0.0]])
def test_sign_consensus_on_adversarial_values_equals_the_masked_definition(weights, normalize):
    """Exact zeros everywhere, sums that cancel to 0 (σ ties to +), one expert
    alone: the mask-free kernel gives the definition's bits and leaves the
    caller's deltas as they were."""
    gen = torch.Generator().manual_seed(3)
    n = 4096
    xs = [(torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.4)).to(torch.bfloat16).float()
          for _ in weights]
    xs[1][:512] = -xs[0][:512]  # pairs that cancel exactly
    xs[2][:512] = 0.0
    xs[3][:512] = 0.0
    xs[3][512:600] = torch.linspace(-1, 1, 88)  # one expert alone where the others are 0
    for x in xs[:3]:
        x[512:600] = 0.0
    base = torch.randn(n, generator=gen)
    before = [x.clone() for x in xs]
    got = sign_consensus(base, list(zip(weights, xs)), normalize, 0.7)
    assert torch.equal(got, ref.consensus_combine(base, weights, xs, normalize, 0.7))
    assert all(torch.equal(x, b) for x, b in zip(xs, before))

"""nearswap and arcee_fusion: what each does to an entry, beyond the registry-wide checks of test_kernels.py.

Expected values are worked out by hand or from the definitions with plain torch (torch.quantile's
``lower`` interpolation is the floor(q (n - 1)) order statistic the threshold is defined with), never
from the kernels' own helpers.
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.spec.operators.kernels import merge
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import OPERATORS, validate_spec
from tests.spec.operators import reference as ref
from tests.spec.operators.table import context, make_inputs, params_for


def _nearswap(base, delta, t):
    return merge(base, [delta], context("nearswap", base.shape, ["a"], params_for("nearswap", [{}], {"t": t}, ["a"])))


def _fusion(base, delta):
    return merge(base, [delta], context("arcee_fusion", base.shape, ["a"], params_for("arcee_fusion", [{}], {},
                                                                                         ["a"])))


# ------------------------------------------------------------------ nearswap


def test_nearswap_takes_the_expert_within_t_and_moves_t_toward_it_elsewhere():
    base = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -2.0, 0.5])
    delta = torch.tensor([0.0, 2.0**-24, 0.0078125, 0.015625, -0.25, 0.5, -0.0625])
    out = _nearswap(base, delta, 0.015625)
    # |out - B| = min(|Δ|, t), toward the expert; exact here (powers of two)
    want = base + torch.sign(delta) * torch.minimum(delta.abs(), torch.tensor(0.015625))
    assert torch.equal(out, want)


def test_nearswap_t_zero_is_the_base_and_a_large_t_the_expert():
    base, (delta,) = make_inputs((9, 7), 1, seed=3)
    assert torch.equal(_nearswap(base, delta, 0.0), base)
    assert torch.equal(_nearswap(base, delta, 1e3), base + delta)


def test_nearswap_t_is_a_distance_with_no_upper_end():
    """mergekit's t here is not slerp's fraction: t > 1 is valid (every entry nearer than t is swapped)."""
    validate_spec(MergeSpec("nearswap", (("a", {}),), {"t": 5.0}, 0))
    assert OPERATORS["slerp"].global_params.definitions()[0].bounds == "[0, 1]"  # slerp's t keeps its range


def test_nearswap_streams_with_a_bound_of_one():
    params = params_for("nearswap", [{}], {"t": 0.01}, ["a"])
    assert OPERATORS["nearswap"].streams_with(params, False)
    assert OPERATORS["nearswap"].beta(params) == [1.0]
    base, (delta,) = make_inputs((16, 5), 1, seed=4)
    assert bool(((_nearswap(base, delta, 0.01) - base).abs() <= delta.abs()).all())


# -------------------------------------------------------------- arcee_fusion


def _lower_quantile_threshold(importance: torch.Tensor) -> torch.Tensor:
    q = torch.quantile(importance.reshape(-1), torch.tensor([0.25, 0.5, 0.75]), interpolation="lower")
    return q[1] + 1.5 * (q[2] - q[0])


def test_arcee_fusion_keeps_the_changes_of_the_row_that_moved_its_distribution():
    """Rows 0-6 change a little, row 7 a lot: its KL divergence makes its entries the outliers."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 16, generator=gen)
    delta = torch.randn(8, 16, generator=gen) * 0.01
    delta[7] = torch.randn(16, generator=gen)
    out = _fusion(base, delta)
    kept = out != base
    assert kept[7].sum() >= 8 and not kept[:7].any()
    assert torch.equal(out[7][kept[7]], (base + delta)[7][kept[7]])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 64, 333])
def test_arcee_fusion_threshold_is_the_lower_order_statistic_rule(n):
    """A 1-D tensor is one row: every importance is |Δ| times the same divergence, and the kept entries are
    those at or above median + 1.5 IQR with floor(q (n - 1)) quantiles."""
    gen = torch.Generator().manual_seed(n)
    base, delta = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    importance = ref.arcee_importance(base, delta)
    keep = importance >= _lower_quantile_threshold(importance)
    assert torch.equal(_fusion(base, delta), torch.where(keep, base + delta, base))


def test_arcee_fusion_uses_exact_quantiles_on_large_tensors():
    """Over 1M elements mergekit estimates the quantiles from a random sample; here they are exact, so the
    result is the reference's and the same on every run."""
    base, (delta,) = make_inputs((1100, 1000), 1, seed=5, quantize=False)
    out = _fusion(base, delta)
    assert torch.equal(out, _fusion(base, delta))
    torch.testing.assert_close(out, ref.arcee_fusion(base, delta), rtol=0, atol=0)


def test_arcee_fusion_is_tensor_level():
    params = params_for("arcee_fusion", [{}], {}, ["a"])
    assert not OPERATORS["arcee_fusion"].streams_with(params, True)
    assert "whole tensors" in OPERATORS["arcee_fusion"].budget_note
    base, (delta,) = make_inputs((8, 4), 1)
    with pytest.raises(ValueError, match="tensor-level"):
        merge(base[:4], [delta[:4]], context("arcee_fusion", (8, 4), ["a"], params).for_rows(0))


# ---------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)")
def test_fusions_on_cuda_equal_the_cpu():
    base, (delta,) = make_inputs((1100, 1000), 1, seed=6, quantize=False)
    on_gpu = base.cuda(), delta.cuda()
    assert torch.equal(_nearswap(*on_gpu, 0.01).cpu(), _nearswap(base, delta, 0.01))
    fused = _fusion(*on_gpu)
    assert fused.device.type == "cuda"
    # float64 row sums may round differently on the GPU: an entry at the threshold may flip, no more
    assert int((fused.cpu() != _fusion(base, delta)).sum()) <= 2

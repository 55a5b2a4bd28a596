"""Model stock with ``filter_wise: true``: one interpolation ratio per row (filter) along the last dimension.

The reference (``reference.model_stock_rows``) runs the per-tensor definition on each row in turn, in
float64; the rows here are built so that the per-row ratios differ from the tensor's.
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.spec.operators.kernels import merge
from mergepipe.spec.operators.base import TensorParams
from mergepipe.spec.operators import OPERATORS
from tests.spec.operators import reference as ref
from tests.spec.operators.table import IDS, context, make_inputs, params_for

SHAPES = [(29, 17), (40,), (5, 3, 4), (7, 1), (1, 50), ()]


def _params(k: int, filter_wise: bool = True, ids=IDS) -> TensorParams:
    return params_for("model_stock", [{}] * k, {"filter_wise": filter_wise}, ids)


def _merge(base, deltas, ids=IDS, filter_wise=True):
    return merge(base, deltas, context("model_stock", base.shape, ids[: len(deltas)],
                                       _params(len(deltas), filter_wise, ids)))


def _sorted(ids, deltas):
    return [d for _, d in sorted(zip(ids, deltas), key=lambda pair: pair[0])]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_row_takes_its_own_ratio(shape):
    base, deltas = make_inputs(shape, 3, seed=len(shape) + 1)
    out = _merge(base, deltas)
    want = ref.model_stock_rows(base, _sorted(IDS, deltas))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)


def test_rows_that_agree_take_the_full_step_and_opposed_rows_keep_the_base():
    """Row 0: identical deltas (cos 1, t = 1); row 1: opposite deltas (cos -1, t = 0: the base, bit for bit);
    row 2: orthogonal deltas (cos 0, t = 0)."""
    base = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    a = torch.tensor([[0.5, -0.25, 1.0, 0.125], [0.5, 0.5, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    b = torch.tensor([[0.5, -0.25, 1.0, 0.125], [-0.5, -0.5, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    out = _merge(base, [a, b], ["a", "b"])
    torch.testing.assert_close(out[0], base[0] + a[0])
    assert torch.equal(out[1], base[1]) and torch.equal(out[2], base[2])
    # per tensor one cosine for all three rows: row 0 takes only part of the step
    whole = _merge(base, [a, b], ["a", "b"], filter_wise=False)
    assert not torch.allclose(whole[0], base[0] + a[0])


def test_a_vector_is_one_row_like_the_tensor():
    base, deltas = make_inputs((40,), 3, seed=9)
    torch.testing.assert_close(_merge(base, deltas), _merge(base, deltas, filter_wise=False), rtol=1e-6, atol=1e-7)


def test_an_unread_expert_is_a_zero_delta_and_order_does_not_matter():
    base, deltas = make_inputs((12, 9), 3, seed=4)
    unread = _merge(base, [deltas[0], None, deltas[2]])
    zeros = _merge(base, [deltas[0], torch.zeros_like(deltas[1]), deltas[2]])
    assert torch.equal(unread, zeros)
    reordered = _merge(base, deltas[::-1], IDS[::-1])
    assert torch.equal(_merge(base, deltas), reordered)
    assert torch.equal(_merge(base, [None, None, None]), base)


def test_filter_wise_is_model_stocks_global_switch_off_by_default():
    (definition,) = OPERATORS["model_stock"].global_params.definitions()
    assert (definition.kind, definition.scope, OPERATORS["model_stock"].global_params().filter_wise) == (
        "bool", "global", False)
    assert OPERATORS["model_stock"].global_params.names() == ("filter_wise",)


def test_filter_wise_is_tensor_level():
    params = _params(2, ids=["a", "b"])
    assert not OPERATORS["model_stock"].streams_with(params, True)
    base, deltas = make_inputs((8, 4), 2)
    with pytest.raises(ValueError, match="tensor-level"):
        merge(base[:4], [d[:4] for d in deltas], context("model_stock", (8, 4), ["a", "b"], params))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)")
def test_filter_wise_on_cuda_is_close_to_the_cpu():
    base, deltas = make_inputs((64, 33), 3, seed=2)
    gpu = _merge(base.cuda(), [d.cuda() for d in deltas])
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), _merge(base, deltas), rtol=1e-6, atol=1e-7)

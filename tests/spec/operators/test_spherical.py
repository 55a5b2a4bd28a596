"""nuslerp, multislerp and karcher against their float64 references (``reference.py``), in every mode.

The shared kernel tests (``test_kernels.py``) run each with its ``CASES`` configuration; these cover the
settings and the edge cases of each formula: both forms of nuslerp and multislerp (task vectors, or the
models with the base one of them), nuslerp's vectors (whole tensor, rows, columns), zero and opposite
points, karcher's iterations.
"""

from __future__ import annotations

import math

import pytest
import torch

from mergepipe.spec.operators import spherical as nuslerp_module
from mergepipe.spec.operators.kernels import merge
from mergepipe.errors import EngineError
from tests.spec.operators import reference as ref
from tests.spec.operators.table import as_dicts, context, make_inputs, params_for

SHAPES = [(29, 17), (5, 3, 4), (1, 50), (7, 1), (40,), ()]
IDS = ["a", "b", "c", "d"]  # id order: the kernels' summation order is the order given


def run(name, base, deltas, per_expert, global_):
    ids = IDS[: len(per_expert)]
    params = params_for(name, per_expert, global_, ids)
    return merge(base, deltas, context(name, tuple(base.shape), ids, params)), params


def reference(name, base, deltas, params):
    per_expert, global_ = as_dicts(params)
    if name == "karcher":
        return ref.karcher(base, deltas, global_)
    return getattr(ref, name)(base, deltas, per_expert, global_)


def close(got, want):
    """Within 4 float32 steps of the result's largest element: the kernels' fp32 vector arithmetic against
    a float64 reference."""
    step = 2.0**-23 * max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    diff = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    assert got.shape == want.shape and diff <= 4 * step, f"{diff / step:.1f} float32 steps apart"


# ------------------------------------------------------------------ nuslerp


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("flatten, row_wise", [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("task_vectors", [True, False], ids=["task vectors", "models"])
def test_nuslerp_matches_the_reference(shape, flatten, row_wise, task_vectors):
    g = {"nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}
    if task_vectors:
        experts = [{"weight": 0.3}, {"weight": 0.9}]
    else:
        experts, g = [{"weight": 0.9}], {**g, "task_vectors": False, "base_weight": 0.3}
    base, deltas = make_inputs(shape, len(experts), seed=3, scale=0.5, quantize=False)
    got, params = run("nuslerp", base, deltas, experts, g)
    close(got, reference("nuslerp", base, deltas, params))


def test_nuslerp_vectors_are_the_whole_tensor_its_rows_or_its_columns():
    """Each mode interpolates its own vectors: a column of a row-wise merge is the nuslerp of that column."""
    base, deltas = make_inputs((6, 5), 2, seed=1, scale=0.5, quantize=False)
    experts = [{"weight": 0.4}, {"weight": 0.6}]
    rows, _ = run("nuslerp", base, deltas, experts, {"nuslerp_flatten": False})
    columns, _ = run("nuslerp", base, deltas, experts, {"nuslerp_flatten": False, "nuslerp_row_wise": True})
    for r in range(6):
        one, _ = run("nuslerp", base[r], [d[r] for d in deltas], experts, {})
        close(rows[r], one)
    for c in range(5):
        one, _ = run("nuslerp", base[:, c].contiguous(), [d[:, c].contiguous() for d in deltas], experts, {})
        close(columns[:, c], one)
    whole, _ = run("nuslerp", base, deltas, experts, {})
    flat, _ = run("nuslerp", base.reshape(-1), [d.reshape(-1) for d in deltas], experts, {})
    assert torch.equal(whole.reshape(-1), flat)


def test_nuslerp_shares_are_halves_when_the_weights_cancel():
    base, deltas = make_inputs((9, 4), 2, seed=2, scale=0.5, quantize=False)
    cancel, _ = run("nuslerp", base, deltas, [{"weight": 1.0}, {"weight": -1.0}], {})
    equal, _ = run("nuslerp", base, deltas, [{"weight": 2.0}, {"weight": 2.0}], {})
    assert torch.equal(cancel, equal)


def test_nuslerp_of_opposite_one_element_vectors_is_the_lerp():
    """The columns of a [1, n] tensor are single numbers: two of opposite signs are colinear, exactly."""
    base = torch.randn(1, 8)
    d0 = torch.randn(1, 8)
    d1 = d0 * -3.0
    got, _ = run("nuslerp", base, [d0, d1], [{"weight": 0.25}, {"weight": 0.75}],
                 {"nuslerp_flatten": False, "nuslerp_row_wise": True})
    assert torch.equal(got, base + (d0 * 0.25 + d1 * 0.75))


def test_nuslerp_with_a_zero_task_vector_treats_it_as_orthogonal():
    """A zero vector has cos θ = 0 (mergekit's normalisation), so the other is scaled by sin(p π/2)."""
    base, (delta,) = make_inputs((7, 3), 1, seed=5, scale=0.5, quantize=False)
    got, _ = run("nuslerp", base, [None, delta], [{"weight": 0.5}, {"weight": 0.5}], {})
    close(got, base + delta * math.sin(0.5 * math.pi / 2))


def test_nuslerp_of_the_models_reaches_its_ends():
    base, (delta,) = make_inputs((7, 3), 1, seed=6, scale=0.5, quantize=False)
    for base_weight, weight, want in [(1.0, 0.0, base), (0.0, 1.0, base + delta)]:
        got, _ = run("nuslerp", base, [delta], [{"weight": weight}],
                     {"task_vectors": False, "base_weight": base_weight})
        close(got, want)


def test_nuslerp_dot_products_do_not_depend_on_the_slice_size(monkeypatch):
    base, deltas = make_inputs((29, 17), 2, seed=9, scale=0.5, quantize=False)
    experts = [{"weight": 0.3}, {"weight": 0.9}]
    settings = [{}, {"nuslerp_flatten": False}, {"nuslerp_flatten": False, "nuslerp_row_wise": True}]
    whole = [run("nuslerp", base, deltas, experts, g)[0] for g in settings]
    monkeypatch.setattr(nuslerp_module, "DOT_SLICE", 5)
    for g, want in zip(settings, whole):
        torch.testing.assert_close(run("nuslerp", base, deltas, experts, g)[0], want, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------- multislerp


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("task_vectors", [True, False], ids=["task vectors", "models"])
def test_multislerp_matches_the_tangent_space_reference(shape, normalize, task_vectors):
    """The reference takes mergekit's tangent-space step in float64; the kernel leaves out that step,
    whose exact value is 0."""
    experts = [{"weight": 0.2}, {"weight": 0.5}, {"weight": 1.3}]
    g = {"normalize_weights": normalize}
    if not task_vectors:
        g = {**g, "task_vectors": False, "base_weight": 0.4}
    base, deltas = make_inputs(shape, 3, seed=4, scale=0.5, quantize=False)
    got, params = run("multislerp", base, deltas, experts, g)
    close(got, reference("multislerp", base, deltas, params))


def test_multislerp_of_one_task_vector_is_that_model():
    base, deltas = make_inputs((8, 3), 1, seed=7)
    got, _ = run("multislerp", base, deltas, [{"weight": 0.3}], {})
    assert torch.equal(got, base + deltas[0])


def test_multislerp_of_two_cancelling_points_is_their_lerp_and_of_more_is_refused():
    base, (delta,) = make_inputs((8, 3), 1, seed=8, quantize=False)
    got, _ = run("multislerp", base, [delta, -delta], [{"weight": 1.0}, {"weight": 1.0}], {})
    assert torch.equal(got, base + (delta * 0.5 + (-delta) * 0.5))
    with pytest.raises(EngineError, match=r"^multislerp: the weighted points of tensor .* cancel out.*; change the "
                                          r"weights$"):
        run("multislerp", base, [delta, -delta, delta, -delta],
            [{"weight": 1.0}] * 4, {})


def test_multislerp_rescales_to_the_weighted_mean_norm():
    base, deltas = make_inputs((16, 4), 2, seed=10, scale=0.5, quantize=False)
    got, _ = run("multislerp", base, deltas, [{"weight": 1.0}, {"weight": 3.0}], {})
    want = 0.25 * deltas[0].double().norm() + 0.75 * deltas[1].double().norm()
    assert math.isclose(float((got - base).double().norm()), float(want), rel_tol=1e-5)


# ------------------------------------------------------------------ karcher


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("max_iter, tol", [(0, 1e-5), (1, 1e-5), (10, 1e-5), (50, 1e-9), (3, 0.5)])
def test_karcher_matches_the_reference(shape, max_iter, tol):
    base, deltas = make_inputs(shape, 3, seed=11, scale=0.5, quantize=False)
    got, params = run("karcher", base, deltas, [{}, {}, {}], {"max_iter": max_iter, "tol": tol})
    close(got, reference("karcher", base, deltas, params))


def test_karcher_of_two_models_is_their_geodesic_midpoint():
    """Two points on the sphere: the Karcher mean is the normalised sum of the unit vectors."""
    base, (delta,) = make_inputs((12, 6), 1, seed=12, scale=0.7, quantize=False)
    got, _ = run("karcher", base, [delta], [{}], {})
    b, e = base.double(), (base + delta).double()
    mid = b / b.norm() + e / e.norm()
    close(got, (mid / mid.norm() * (b.norm() + e.norm()) / 2).float())


def test_karcher_of_points_within_tol_of_zero_is_zero():
    base = torch.full((4, 3), 1e-7)
    got, _ = run("karcher", base, [torch.full((4, 3), 1e-7)], [{}], {})
    assert torch.equal(got, torch.zeros(4, 3))


# --------------------------------------------------------------------- cuda


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)")
@pytest.mark.parametrize("name, experts, g", [
    ("nuslerp", [{"weight": 0.3}, {"weight": 0.9}], {}),
    ("nuslerp", [{"weight": 0.3}, {"weight": 0.9}], {"nuslerp_flatten": False}),
    ("nuslerp", [{"weight": 0.9}], {"nuslerp_flatten": False, "nuslerp_row_wise": True, "task_vectors": False}),
    ("multislerp", [{"weight": 0.2}, {"weight": 0.5}], {"task_vectors": False, "base_weight": 0.4}),
    ("karcher", [{}, {}], {"max_iter": 20}),
])
def test_on_cuda_equal_the_cpu(name, experts, g):
    base, deltas = make_inputs((61, 33), len(experts), seed=13, scale=0.5, quantize=False)
    on_cpu, _ = run(name, base, deltas, experts, g)
    on_cuda, _ = run(name, base.cuda(), [d.cuda() for d in deltas], experts, g)
    assert on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-6, atol=1e-7)

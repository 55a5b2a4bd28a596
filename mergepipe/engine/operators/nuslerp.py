"""NuSLERP: spherical interpolation of two points, over whole tensors or vector by vector.

With two points v0, v1 and their weights w0, w1, each point's share is
``pi = wi / (w0 + w1)`` (both 1/2 when |w0 + w1| < 1e-6), and per vector pair

    ui    = vi / max(||vi||, 1e-7)
    cos θ = clamp(<u0, u1>, -1, 1)
    1 - cos²θ <= 1e-16  (colinear):  out = p0 v0 + p1 v1                    (lerp)
    otherwise:                       out = (sin(p0 θ) v0 + sin(p1 θ) v1) / sin θ

A zero vector has cos θ = 0 (θ = π/2), as in mergekit. The vectors are the
whole tensor (``nuslerp_flatten: true``, the default), else the vectors along
the last dimension (a matrix's rows), or along the first with
``nuslerp_row_wise: true`` (a matrix's columns: mergekit's ``dim=0``; it
calls them row vectors); a 0-d or 1-D tensor is one vector either way.

How mergekit's config maps (``spec/mergekit.py``): with a ``base_model``
(``task_vectors: true``, the default) the points are the two experts' task
vectors Δ0, Δ1 and the result is ``B + out``; without one the first model is
MergePipe's base and the points are B itself, weighted by ``base_weight``
(the first model's weight), and the one expert ``B + Δ`` (``task_vectors:
false``). Swapping the points and their weights gives the same formula, so
the order of the experts does not matter; p0 and p1 are computed from their
own weights.

Tensor-level (``streaming = False``) for every setting: a partial budget reads
a tensor of every expert or of none; an unread tensor keeps the base's. A
delta that was not read counts as 0 (a zero task vector, or the expert equal
to the base).

Intentional differences from mergekit 0.1.5: norms and dot products are
float64 sums of exact products, and θ and the two coefficients of each vector
pair are float64 (mergekit: fp32); the result is ``v0 c0 + v1 c1`` with ``ci
= sin(pi θ) / sin θ`` (mergekit divides the sum by sin θ); when every delta
is zero the result is the base's bytes. Near θ = π (points nearly opposite)
the formula itself is singular, so there the two can differ by more than
rounding; vectors of one element (the columns of a [1, n] tensor, row-wise)
are exactly colinear in both and take the lerp.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._spherical import models, task_vectors, unchanged
from mergepipe.engine.operators.context import BlockContext

#: mergekit's floor on a vector's norm before dividing by it.
NORM_FLOOR = 1e-7
#: mergekit's colinearity test: 1 - cos²θ at or below this square.
COLINEAR_EPS = 1e-8
#: mergekit takes both shares as 1/2 when the two weights sum to less than this.
ZERO_TOTAL = 1e-6
#: Elements upcast to float64 at a time by ``dot``: a few MB, whatever the tensor.
DOT_SLICE = 1 << 18


def nuslerp(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    g = ctx.global_params
    if base.numel() == 0 or unchanged(deltas):
        return base.clone()
    if g.task_vectors:
        (v0, v1), (w0, w1) = task_vectors(base, deltas, ctx)
    else:
        (v0, v1), (w0, w1) = models(base, deltas, ctx, g.base_weight)
    total = w0 + w1
    p0, p1 = (0.5, 0.5) if abs(total) < ZERO_TOTAL else (w0 / total, w1 / total)
    # as a matrix whose rows (axis 1) or columns (axis 0) are the vectors
    if g.nuslerp_flatten or base.dim() <= 1:
        shape, axis = (base.numel(), 1), 0
    elif g.nuslerp_row_wise:
        shape, axis = (base.shape[0], base.numel() // base.shape[0]), 0
    else:
        shape, axis = (base.numel() // base.shape[-1], base.shape[-1]), 1
    m0, m1 = v0.reshape(shape), v1.reshape(shape)
    c0, c1 = coefficients(m0, m1, p0, p1, axis)
    out = (m0 * c0 + m1 * c1).reshape(base.shape)
    return base + out if g.task_vectors else out


def coefficients(
    m0: torch.Tensor, m1: torch.Tensor, p0: float, p1: float, axis: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(c0, c1)`` of ``out = v0 c0 + v1 c1`` for every pair of vectors along ``axis`` of the matrices
    ``m0``, ``m1`` (kept as a size-1 axis, so they broadcast over the vectors), computed in float64."""
    n0 = dot(m0, m0, axis).sqrt().clamp(min=NORM_FLOOR)
    n1 = dot(m1, m1, axis).sqrt().clamp(min=NORM_FLOOR)
    cos = (dot(m0, m1, axis) / (n0 * n1)).clamp(-1.0, 1.0)
    colinear = (1.0 - cos * cos) <= COLINEAR_EPS**2
    theta = torch.acos(torch.where(colinear, 0.0, cos))
    sin_theta = torch.where(colinear, 1.0, torch.sin(theta))
    c0 = torch.where(colinear, p0, torch.sin(theta * p0) / sin_theta)
    c1 = torch.where(colinear, p1, torch.sin(theta * p1) / sin_theta)
    return c0.float(), c1.float()


def dot(a: torch.Tensor, b: torch.Tensor, axis: int) -> torch.Tensor:
    """float64 ``Σ a·b`` along ``axis`` of two matrices (kept). Every product is exact (two fp32 values
    multiply exactly in float64), so two one-element vectors get cos θ = ±1 exactly and take the lerp, where
    an fp32 product could put an opposite pair just inside the singular end of the formula. Rows are upcast a
    slice at a time: the float64 copies stay small whatever the tensor."""
    step = max(1, DOT_SLICE // a.shape[1])
    sums = [
        (a[i : i + step].double() * b[i : i + step].double()).sum(dim=axis, keepdim=True)
        for i in range(0, a.shape[0], step)
    ]
    if axis == 1:
        return torch.cat(sums)
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total

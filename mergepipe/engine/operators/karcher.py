"""Karcher mean: the Riemannian mean of the models on the unit hypersphere, over whole tensors.

With N points xi (each tensor one vector), equal weights 1/N:

    ni = ||xi||,  ui = xi / ni;  the valid points have ni > tol (none: out = 0)
    ai = 1 / (number of valid points)
    m  = Σ ai ui / ||Σ ai ui||          (the first valid ui if that norm is < tol)
    repeat max_iter times:
        for each valid i:  θi = 2 asin(||ui - m|| / 2);  skip it if θi < tol
        T = Σ ai θi / sin θi (ui - cos θi m)        (the log map's mean)
        stop if ||T|| < tol
        m = cos ||T|| m + sin ||T|| T / ||T||,  then m / ||m|| (if ||m|| > tol)
    out = m * Σ ni / N                  (every point's norm, valid or not)

How mergekit's config maps (``spec/mergekit.py``): mergekit's karcher
averages every model it is given, the ``base_model`` among them (appended
when it is not listed); it has no task-vector form and no weights. MergePipe's
base is the ``base_model``, else the first model, and it is always one of
the points: they are B and every expert ``B + Δi`` (an unread delta gives
the base), base first, then experts by id.

Tensor-level (``streaming = False``): the norms and angles are the whole
tensor's. A partial budget reads a tensor of every expert or of none; an
unread tensor keeps the base's.

The angle comes from the chord ``||ui - m||``, not from ``acos <m, ui>`` (mergekit's form, equal in
exact arithmetic): fine-tunes lie within ~1e-4 rad of each other, where the cosine is 1 to within the
rounding of the unit vectors, so ``acos`` returns noise (or 0, skipping the point) while the chord keeps
the angle to its own relative precision.

Intentional differences from mergekit 0.1.5: dot products and norms are
accumulated in float64 and the angles and step lengths computed from them
in float64 (mergekit sums whole tensors in fp32, and its result carries that
rounding), so an iteration whose step length lies within fp32 rounding of
``tol`` may stop one step earlier or later than mergekit's; when every
delta is zero the result is the base's bytes (mergekit rescales the base's
unit vector by its norm).
"""

from __future__ import annotations

import math

import torch

from mergepipe.engine.operators._spherical import unchanged
from mergepipe.engine.operators.context import BlockContext


def karcher(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    g = ctx.global_params
    if base.numel() == 0 or unchanged(deltas):
        return base.clone()
    count = 1 + len(deltas)
    norms: list[float] = []
    units: list[torch.Tensor] = []  # of the valid points, in order: the base, then experts by id
    for d in [None, *(deltas[i] for i in ctx.order)]:
        x = base if d is None else base + d
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        norms.append(norm)
        if norm > g.tol:
            units.append(x / norm)
    if not units:
        return torch.zeros_like(base)
    mean = karcher_mean(units, g.max_iter, g.tol)
    return mean * (math.fsum(norms) / count)


def karcher_mean(units: list[torch.Tensor], max_iter: int, tol: float) -> torch.Tensor:
    """The equally weighted Karcher mean of unit vectors (the module docstring), a unit vector."""
    share = 1.0 / len(units)
    mean = units[0] * share
    for u in units[1:]:
        mean = mean + u * share
    norm = _norm(mean)
    mean = units[0].clone() if norm < tol else mean / norm
    for _ in range(max_iter):
        tangent: torch.Tensor | None = None
        for u in units:
            theta = 2.0 * math.asin(min(1.0, _norm(u - mean) / 2.0))  # the chord's angle (see below)
            if theta < tol:
                continue
            cos = math.cos(theta)
            step = (u - mean * cos) * (share * theta / math.sin(theta))
            tangent = step if tangent is None else tangent + step
        length = 0.0 if tangent is None else _norm(tangent)
        if tangent is None or length < tol:
            break
        mean = mean * math.cos(length) + tangent * (math.sin(length) / length)
        norm = _norm(mean)
        if norm > tol:
            mean = mean / norm
    return mean


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))

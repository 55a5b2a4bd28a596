"""Karcher mean: the Riemannian mean of the models on the unit hypersphere, over whole tensors. With the
N points B and every B + Δi (base first, then experts by id; an unread delta gives B), each one vector:

    ni = ||xi||, ui = xi / ni; the valid points have ni > tol (none: out = 0); ai = 1 / #valid
    m  = Σ ai ui / ||Σ ai ui||             (the first valid ui if that norm is < tol)
    repeat max_iter times:
        θi = 2 asin(||ui - m|| / 2) for each valid i, skipped if θi < tol
        T  = Σ ai θi / sin θi (ui - cos θi m); stop if ||T|| < tol
        m  = cos ||T|| m + sin ||T|| T / ||T||, then m / ||m|| (if ||m|| > tol)
    out = m Σ ni / N

mergekit's ``karcher`` (every model with equal weights, the ``base_model`` among them). The angle comes
from the chord, not ``acos <m, ui>``: fine-tunes lie within ~1e-4 rad, where the cosine rounds to 1.
Sums, angles and steps in float64. Every delta zero: the base's bytes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

from mergepipe.spec.operators.base import BlockContext, OperatorDef, ParamDef, Params, register
from mergepipe.spec.operators.kernels import unchanged

if TYPE_CHECKING:
    import torch


class KarcherParams(Params):
    max_iter: Annotated[int, ParamDef("max_iter", "int", "global", "Karcher: the most iterations of the mean", 0.0)] = (
        10
    )
    tol: Annotated[
        float,
        ParamDef(
            "tol",
            "real",
            "global",
            "Karcher: stop when a step is shorter; points of norm at most tol count as zero",
            0.0,
        ),
    ] = 1e-5


@register
class KarcherDef(OperatorDef):
    name = "karcher"
    summary = "Riemannian (Karcher) mean of the base and the experts on the sphere, rescaled to their mean norm"
    global_params = KarcherParams
    streaming = False
    mergekit_points = True
    budget_note = (
        "karcher averages whole tensors, each from every model or not at all (then it keeps the base's "
        "values, the base being one of the averaged models)"
    )

    def kernel(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        import torch

        g = ctx.global_params
        if base.numel() == 0 or unchanged(deltas):
            return base.clone()
        norms: list[float] = []
        units: list[torch.Tensor] = []  # of the valid points, in order
        for d in [None, *(deltas[i] for i in ctx.order)]:
            x = base if d is None else base + d
            norms.append(_norm(x))
            if norms[-1] > g.tol:
                units.append(x / norms[-1])
        if not units:
            return torch.zeros_like(base)
        share = 1.0 / len(units)
        mean = units[0] * share
        for u in units[1:]:
            mean = mean + u * share
        norm = _norm(mean)
        mean = units[0].clone() if norm < g.tol else mean / norm
        for _ in range(g.max_iter):
            tangent: torch.Tensor | None = None
            for u in units:
                theta = 2.0 * math.asin(min(1.0, _norm(u - mean) / 2.0))
                if theta < g.tol:
                    continue
                step = (u - mean * math.cos(theta)) * (share * theta / math.sin(theta))
                tangent = step if tangent is None else tangent + step
            length = 0.0 if tangent is None else _norm(tangent)
            if tangent is None or length < g.tol:
                break
            mean = mean * math.cos(length) + tangent * (math.sin(length) / length)
            norm = _norm(mean)
            if norm > g.tol:
                mean = mean / norm
        return mean * (math.fsum(norms) / len(norms))


def _norm(x: torch.Tensor) -> float:
    import torch

    return float(torch.linalg.vector_norm(x, dtype=torch.float64))

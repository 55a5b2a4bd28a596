"""Select, calculate, erase."""

from __future__ import annotations

import math
from typing import Annotated

from mergepipe.spec.operators.base import BlockContext, OperatorDef, ParamDef, Params, Tensor, register
from mergepipe.spec.operators.kernels import keep_mask, top_k

#: mergekit replaces weights whose sum is below this by equal weights 1/K.
UNIFORM_BELOW = 1e-6
#: mergekit clamps the sum of the agreeing weights from below by this.
DIVISOR_MIN = 1e-6

SELECT_TOPK = ParamDef(
    "select_topk", "SCE: fraction of the entries that vary across the experts kept, those of largest variance", "[0, 1]"
)


class VarianceSelection(Params):
    select_topk: Annotated[float, SELECT_TOPK] = 1.0


@register
class SceDef(OperatorDef):
    """Select entries by their variance across the experts, calculate one weight per expert, erase minority
    signs; over whole tensors. With K experts, deltas Δi of n entries and select_topk = s:

        select (s < 1): v_j = Σi (Δi_j - m_j)² / K, m_j = Σi Δi_j / K (float64, experts by id, rounded to fp32);
                        keep the k = int(s #{j: v_j != 0}) entries of largest v, ties first in row-major
                        order; xi = Δi there, else 0                          (s = 1: xi = Δi)
        calculate:      wi = Σ_j xi_j² / n (float64 sums);  ci = wi / Σw, or 1/K when Σw < 1e-6
        erase:          σ_j = +1 if Σi xi_j >= 0 else -1;  ai_j = [σ_j xi_j > 0]
        merge:          out = B + Σi ci ai xi / max(Σi ci ai, 1e-6)

    mergekit's ``sce`` (``base_model`` required; ``select_topk`` global). An expert tensor not read (a delta
    store plan's) is Δ = 0 and still one of the K: its zeros enter the variance, its weight is 0.
    """

    name = "sce"
    summary = "keep the entries that vary most across the experts, weight experts by energy, erase minority signs"
    global_params = VarianceSelection
    streaming = False
    budget_note = (
        "sce merges whole tensors, each from every expert or not at all (then it keeps the base's "
        "values); an expert tensor a delta-store plan leaves unread counts as Δ = 0 among the experts "
        "(its zeros enter the variance; its weight is 0)"
    )

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        ordered = [deltas[i] for i in ctx.order]
        if base.numel() == 0 or all(d is None for d in ordered):
            return base.clone()
        xs = ordered
        if ctx.params.global_.select_topk < 1.0:
            keep = variance_keep(ordered, ctx.params.global_.select_topk)
            drop = ~keep
            xs = [
                None if d is None else d.masked_fill_(drop, 0.0) if ctx.owns_deltas else torch.where(keep, d, 0.0)
                for d in ordered
            ]
        energy = [0.0 if x is None else float((x * x).sum(dtype=torch.float64)) / base.numel() for x in xs]
        total_energy = math.fsum(energy)
        uniform = abs(total_energy) < UNIFORM_BELOW
        coefs = [1.0 / len(xs) if uniform else e / total_energy for e in energy]
        present = [(c, x) for c, x in zip(coefs, xs) if x is not None]
        total = present[0][1].clone()
        for _, x in present[1:]:
            total.add_(x)
        positive = total >= 0  # the elected sign: +1 here, -1 elsewhere
        numerator = torch.zeros_like(base)
        divisor = torch.zeros_like(base)
        for c, x in present:
            agreeing = torch.where(positive, x > 0, x < 0).to(base.dtype).mul_(c)  # ci where expert i agrees
            divisor.add_(agreeing)
            numerator.add_(agreeing.mul_(x))
        return base + numerator.div_(divisor.clamp_min_(DIVISOR_MIN))


def variance_keep(deltas: list[Tensor | None], fraction: float) -> Tensor:
    """Bool mask of the ``int(fraction · nonzero)`` entries of largest variance across ``deltas`` (None:
    zeros, still counted in K), ties kept first in row-major order."""
    import torch

    present = [d for d in deltas if d is not None]
    mean = torch.zeros_like(present[0], dtype=torch.float64)
    for d in present:
        mean.add_(d)
    mean.div_(len(deltas))
    variance = torch.zeros_like(mean)
    scratch = torch.empty_like(mean)
    for delta in deltas:
        if delta is None:
            torch.mul(mean, mean, out=scratch)  # (0 - m)² = m², bit for bit
        else:
            torch.sub(delta, mean, out=scratch).mul_(scratch)
        variance.add_(scratch)
    rounded = variance.div_(len(deltas)).float()
    flat = rounded.reshape(-1)
    k = min(int(fraction * int(torch.count_nonzero(rounded))), flat.numel())
    return keep_mask(rounded, 0, top_k(flat, k))

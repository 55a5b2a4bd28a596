"""SCE (Wan et al. 2024, FuseChat, arXiv:2408.07990): select entries by their
variance across the experts, calculate one weight per expert, erase the
entries whose sign disagrees with the majority; over whole tensors.

With K experts, deltas Δi of a tensor of n elements and select_topk = s:

    select (s < 1):  m_j = (Σi Δi_j) / K,   v_j = (Σi (Δi_j - m_j)²) / K
                     (element-wise in float64, experts in id order, rounded
                     to fp32: variances equal in exact arithmetic tie)
                     k   = int(s · #{j : v_j != 0}); keep the k entries of
                     largest v, ties at the k-th value kept first in
                     row-major order;  xi = Δi where kept, else 0
                     (s = 1: xi = Δi, nothing is selected away)
    calculate:       wi = (Σ_j xi_j²) / n   (squares in fp32, sums in float64)
                     ci = wi / Σ w,   or 1/K when Σ w < 1e-6
    erase:           σ_j = +1 if Σi xi_j >= 0 else -1;   ai_j = [σ_j xi_j > 0]
    merge:           out = B + (Σi ci ai xi) / max(Σi ci ai, 1e-6)

mergekit's ``sce``: ``base_model`` is MergePipe's base (required; a base also
listed under ``models`` is skipped, as mergekit does), the other models are
the experts, ``parameters: {select_topk}`` is global (mergekit's
``int8_mask`` only changes a mask's storage: the config reader drops it with
a note). There are no per-model parameters.

Tensor-level: the variance top-k and the weights need every expert's whole
tensor, so the planner reads a tensor from every expert or not at all (a
tensor it does not read keeps the base). An expert tensor that is not read
(``None``: a plan of the ``entries`` policy can leave one out) is Δ = 0 and
still one of the K: its zeros enter the variance (so they can move which
entries are selected), its weight is 0 and it never agrees with the elected
sign.

Intentional differences from mergekit 0.1.5 (``sce_merge``): ties at the
k-th largest variance keep the first entries in row-major order (mergekit's
``topk`` keeps any of them: bf16 checkpoints tie often), the variance is
computed in float64 (mergekit: ``torch.var`` over the stacked deltas), k is
``int(s · count)`` in float64 (mergekit multiplies in fp32) and the weights
are summed in float64 (mergekit: fp32 means). Where the selections differ by
an entry the weights differ too, so such a tensor differs a little almost
everywhere; elsewhere the two agree to fp32 rounding.
"""

from __future__ import annotations

import math

import torch

from mergepipe.engine.operators.context import BlockContext

#: mergekit replaces weights whose sum is below this by equal weights 1/K.
UNIFORM_BELOW = 1e-6
#: mergekit clamps the sum of the agreeing weights from below by this.
DIVISOR_MIN = 1e-6


def variance_keep(deltas: list[torch.Tensor | None], fraction: float) -> torch.Tensor:
    """Bool mask of the ``int(fraction · nonzero)`` entries of largest variance across ``deltas``
    (None = zeros, still counted in K), ties kept first in row-major order."""
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
    return top_k_keep(rounded, int(fraction * int(torch.count_nonzero(rounded))))


def top_k_keep(values: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the ``k`` largest ``values``, ties at the k-th value kept first in row-major order."""
    flat = values.reshape(-1)
    n = flat.numel()
    if k <= 0:
        return torch.zeros_like(values, dtype=torch.bool)
    if k >= n:
        return torch.ones_like(values, dtype=torch.bool)
    cut = torch.kthvalue(flat, n - k + 1).values  # the k-th largest value: its bits do not depend on ties
    above = flat > cut
    tied = flat == cut
    room = k - int(above.sum())
    keep = above | (tied & (torch.cumsum(tied, dim=0) <= room))
    return keep.view(values.shape)


def expert_weights(xs: list[torch.Tensor | None], numel: int) -> list[float]:
    """``ci``: each expert's mean squared (selected) delta over their sum, or 1/K when that sum is tiny."""
    energy = [0.0 if x is None else float((x * x).sum(dtype=torch.float64)) / numel for x in xs]
    total = math.fsum(energy)
    if abs(total) < UNIFORM_BELOW:
        return [1.0 / len(xs)] * len(xs)
    return [e / total for e in energy]


def sce(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    ordered = [deltas[i] for i in ctx.order]
    if base.numel() == 0 or all(d is None for d in ordered):
        return base.clone()
    fraction = ctx.global_params.select_topk
    xs = ordered
    if fraction < 1.0:
        keep = variance_keep(ordered, fraction)
        drop = ~keep
        xs = [
            None if d is None else d.masked_fill_(drop, 0.0) if ctx.owns_deltas else torch.where(keep, d, 0.0)
            for d in ordered
        ]
    coefs = expert_weights(xs, base.numel())
    present = [(c, x) for c, x in zip(coefs, xs) if x is not None]
    total = present[0][1].clone()
    for _, x in present[1:]:
        total.add_(x)
    positive = total >= 0  # the elected sign: +1 here, -1 elsewhere
    numerator = torch.zeros_like(base)
    divisor = torch.zeros_like(base)
    for c, x in present:
        agreeing = torch.where(positive, x > 0, x < 0).to(base.dtype).mul_(c)  # ci where expert i agrees, else 0
        divisor.add_(agreeing)
        numerator.add_(agreeing.mul_(x))
    return base + numerator.div_(divisor.clamp_min_(DIVISOR_MIN))

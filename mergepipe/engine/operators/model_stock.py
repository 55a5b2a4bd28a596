"""Model stock (Jang et al. 2024, arXiv:2403.19522), over whole tensors.

With N >= 2 experts and deltas Δi (each tensor flattened to one vector):

    cos   = mean over pairs i < j of  <Δi, Δj> / max(||Δi|| ||Δj||, 1e-6),
            each clamped to [-1, 1]
    t     = N cos / (1 + (N - 1) cos)      (t = 0 when |1 + (N-1) cos| < 1e-6)
    out   = B + t * (Σi Δi) / N            (= t * mean(Ei) + (1 - t) * B)

This is mergekit's ``model_stock`` with ``filter_wise: false`` (its default;
``filter_wise`` is not accepted). An unread expert tensor counts as Δ = 0
(cosine 0 with every other). Tensor-level.

Intentional differences from mergekit 0.1.5: dot products and norms are
accumulated in float64 and the mean cosine is summed exactly; the result is
written in deltas (B + t·mean Δ) so that t = 0 returns B bit for bit.
"""

from __future__ import annotations

import math

import torch

from mergepipe.engine.operators.context import BlockContext

#: mergekit clamps the product of norms from below by this.
NORM_PRODUCT_MIN = 1e-6
#: mergekit keeps the base when |1 + (N-1) cos| is below this.
SINGULAR = 1e-6


def stock_ratio(deltas: list[torch.Tensor | None]) -> float:
    """``t`` from the mean pairwise cosine of the deltas (None = zero delta)."""
    n = len(deltas)
    norms = [0.0 if d is None else float(torch.linalg.vector_norm(d, dtype=torch.float64)) for d in deltas]
    cosines = []
    for i in range(n):
        for j in range(i + 1, n):
            a, b = deltas[i], deltas[j]
            dot = 0.0 if a is None or b is None else float((a * b).sum(dtype=torch.float64))
            cos = dot / max(norms[i] * norms[j], NORM_PRODUCT_MIN)
            cosines.append(min(1.0, max(-1.0, cos)))
    cos = math.fsum(cosines) / len(cosines)
    denominator = 1.0 + (n - 1) * cos
    return 0.0 if abs(denominator) < SINGULAR else n * cos / denominator


def model_stock(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    ordered = [deltas[i] for i in ctx.order]
    t = stock_ratio(ordered)
    present = [d for d in ordered if d is not None]
    if not present or t == 0.0:
        return base.clone()
    total = present[0].clone()
    for d in present[1:]:
        total.add_(d)
    return base + (total / len(deltas)) * t

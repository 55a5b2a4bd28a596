"""Model stock (Jang et al. 2024, arXiv:2403.19522), over whole tensors.

With N >= 2 experts and deltas Δi (each tensor flattened to one vector):

    cos   = mean over pairs i < j of  <Δi, Δj> / max(||Δi|| ||Δj||, 1e-6),
            each clamped to [-1, 1]
    t     = N cos / (1 + (N - 1) cos)      (t = 0 when |1 + (N-1) cos| < 1e-6)
    out   = B + t * (Σi Δi) / N            (= t * mean(Ei) + (1 - t) * B)

This is mergekit's ``model_stock`` (``base_model`` is B, the other models
the experts). With ``filter_wise: true`` (mergekit's meaning) the same is
done for each row along the last dimension (a filter: one output unit's
weights; a 1-D tensor is one row): cos and t per row, each row moved by its
own t. An unread expert tensor counts as Δ = 0 (cosine 0 with every other).
Tensor-level either way: the planner reads all of a tensor's expert blocks
or none.

Intentional differences from mergekit 0.1.5: dot products and norms are
accumulated in float64 and the mean cosine is summed exactly (per tensor)
or in a fixed order (per row); the result is written in deltas
(B + t·mean Δ) so that t = 0 returns B bit for bit.
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


def row_stock_ratios(deltas: list[torch.Tensor | None], rows: int, device: torch.device) -> torch.Tensor:
    """float64 ``t`` of each row of 2-D deltas (None = zero delta), as ``stock_ratio`` per row."""
    n = len(deltas)
    zero = torch.zeros(rows, dtype=torch.float64, device=device)
    norms = [zero if d is None else torch.linalg.vector_norm(d, dim=-1, dtype=torch.float64) for d in deltas]
    total = zero.clone()
    for i in range(n):
        for j in range(i + 1, n):
            a, b = deltas[i], deltas[j]
            if a is not None and b is not None:
                dot = (a * b).sum(dim=-1, dtype=torch.float64)
                total += (dot / (norms[i] * norms[j]).clamp(min=NORM_PRODUCT_MIN)).clamp(-1.0, 1.0)
    cos = total / (n * (n - 1) // 2)
    denominator = 1.0 + (n - 1) * cos
    singular = denominator.abs() < SINGULAR
    return torch.where(singular, zero, n * cos / torch.where(singular, 1.0, denominator))


def model_stock(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    if ctx.global_params.filter_wise:
        return _per_row(base, deltas, ctx)
    ordered = [deltas[i] for i in ctx.order]
    t = stock_ratio(ordered)
    present = [d for d in ordered if d is not None]
    if not present or t == 0.0:
        return base.clone()
    total = present[0].clone()
    for d in present[1:]:
        total.add_(d)
    return base + (total / len(deltas)) * t


def _per_row(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    """``filter_wise``: each row (along the last dimension) moved by its own t."""
    if base.numel() == 0:
        return base.clone()
    width = base.shape[-1] if base.dim() else 1
    rows = base.numel() // width
    ordered = [None if (d := deltas[i]) is None else d.reshape(rows, width) for i in ctx.order]
    t = row_stock_ratios(ordered, rows, base.device).to(torch.float32).unsqueeze(-1)
    present = [d for d in ordered if d is not None]
    if not present:
        return base.clone()
    total = present[0].clone()
    for d in present[1:]:
        total.add_(d)
    base_rows = base.reshape(rows, width)
    moved = base_rows + (total / len(deltas)) * t
    return torch.where(t == 0.0, base_rows, moved).reshape(base.shape)

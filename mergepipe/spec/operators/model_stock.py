"""Model stock (Jang et al. 2024, arXiv:2403.19522)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from mergepipe.spec.operators.base import BlockContext, OperatorDef, ParamDef, Params, Tensor, register

#: mergekit clamps the product of norms from below by this.
NORM_PRODUCT_MIN = 1e-6
#: mergekit keeps the base when |1 + (N-1) cos| is below this.
SINGULAR = 1e-6

FILTER_WISE = ParamDef(
    "filter_wise", "Model stock: one interpolation ratio per row (filter) instead of one per tensor", kind="bool"
)


class Stock(Params):
    filter_wise: Annotated[bool, FILTER_WISE] = False


@register
class ModelStockDef(OperatorDef):
    """Over whole tensors. With N >= 2 experts, each delta flattened to one vector:

        cos = mean over pairs i < j of <Δi, Δj> / max(||Δi|| ||Δj||, 1e-6), each clamped to [-1, 1]
        t   = N cos / (1 + (N - 1) cos)      (t = 0 when |1 + (N-1) cos| < 1e-6)
        out = B + t (Σi Δi) / N              (= t mean(Ei) + (1 - t) B; B itself at t = 0)

    mergekit's ``model_stock``. ``filter_wise: true`` does the same per row along the last dimension (a
    filter; a 1-D tensor is one row), each row moved by its own t. An unread expert counts as Δ = 0. Dot
    products and norms are float64 sums.
    """

    name = "model_stock"
    summary = "average of the experts moved toward the base by their mutual cosine, per tensor (or row)"
    global_params = Stock
    streaming = False
    min_experts = 2

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        if ctx.params.global_.filter_wise:
            if base.numel() == 0:
                return base.clone()
            width = base.shape[-1] if base.dim() else 1
            rows = base.numel() // width
            by_row = [None if (d := deltas[i]) is None else d.reshape(rows, width) for i in ctx.order]
            t = ratios(by_row, rows, base.device).to(torch.float32).unsqueeze(-1)
            present = [d for d in by_row if d is not None]
            if not present:
                return base.clone()
            base_rows = base.reshape(rows, width)
            moved = base_rows + (_total(present) / len(deltas)) * t
            return torch.where(t == 0.0, base_rows, moved).reshape(base.shape)
        ordered = [deltas[i] for i in ctx.order]
        ratio = stock_ratio(ordered)
        present = [d for d in ordered if d is not None]
        if not present or ratio == 0.0:
            return base.clone()
        return base + (_total(present) / len(deltas)) * ratio


def _total(present: list[Tensor]) -> Tensor:
    total = present[0].clone()
    for d in present[1:]:
        total.add_(d)
    return total


def stock_ratio(deltas: list[Tensor | None]) -> float:
    """``t`` of whole tensors (None: a zero delta), the mean cosine summed exactly."""
    import torch

    n = len(deltas)
    norms = [0.0 if d is None else float(torch.linalg.vector_norm(d, dtype=torch.float64)) for d in deltas]
    cosines = []
    for i in range(n):
        for j in range(i + 1, n):
            a, b = deltas[i], deltas[j]
            dot = 0.0 if a is None or b is None else float((a * b).sum(dtype=torch.float64))
            cosines.append(min(1.0, max(-1.0, dot / max(norms[i] * norms[j], NORM_PRODUCT_MIN))))
    cos = math.fsum(cosines) / len(cosines)
    denominator = 1.0 + (n - 1) * cos
    return 0.0 if abs(denominator) < SINGULAR else n * cos / denominator


def ratios(deltas: list[Tensor | None], rows: int, device: Any) -> Tensor:
    """float64 ``t`` of each row of 2-D deltas (None: a zero delta), pairs summed in a fixed order."""
    import torch

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

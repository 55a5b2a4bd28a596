"""RAM, Reinforced Agent Merging (arXiv:2601.13572), and RAM+ tensor-local (``ramplus_tl``)."""

from __future__ import annotations

import math
from typing import Annotated

from mergepipe.spec.operators.base import BlockContext, OperatorDef, ParamDef, Params, Tensor, TensorParams, register

#: RAM's epsilon: mergekit's global threshold on |Δ| (not DELLA's per-expert spread of the same name).
Epsilon = Annotated[
    float, ParamDef("epsilon", "RAM: |Δ| above which an entry counts as changed by the expert", "[0, inf]")
]
GAIN = ParamDef("r", "RAM+: gain on an expert's unique entries, 1 + r min(shared/unique, alpha)", "[0, inf]")


class ChangeThreshold(Params):
    epsilon: Epsilon = 1e-5


class ReinforcedThreshold(Params):
    r: Annotated[float, GAIN] = 0.1
    alpha: Annotated[float, ParamDef("alpha", "RAM+: cap on an expert's shared/unique ratio", "[0, inf]")] = 0.2
    epsilon: Epsilon = 1e-5


def changed_entries(deltas: list[Tensor | None], epsilon: float) -> tuple[list[Tensor], Tensor]:
    """``(xi, c)`` of the deltas read: each with its entries |Δ| <= epsilon zeroed (a NaN is kept, for
    ``merge`` to find), and per entry the number of experts that changed it, in fp32."""
    import torch

    xs = [torch.where(d.abs() <= epsilon, 0.0, d) for d in deltas if d is not None]
    counts = torch.zeros_like(xs[0])
    for x in xs:
        counts.add_(x != 0)
    return xs, counts


@register
class RamDef(OperatorDef):
    """Keep what each expert changed, the mean where several changed an entry. With deltas Δi and epsilon e,
    per entry j (experts by id; an unread expert block takes no part; |m_j| <= Σi |Δi_j|: beta 1):

        xi_j = Δi_j if |Δi_j| > e, else 0;   c_j = #{i : xi_j != 0}
        out_j = B_j + Σi xi_j / max(c_j, 1)
    """

    name = "ram"
    summary = "keep each expert's changed entries (|Δ| > epsilon); the mean where several experts changed one"
    global_params = ChangeThreshold
    error_bound = "consensus"

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # Δ = 0 changes no entry and counts for none

    def beta(self, params: TensorParams) -> list[float]:
        return [1.0] * len(params.experts)

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        ordered = [deltas[i] for i in ctx.order]
        if all(d is None for d in ordered):
            return base.clone()
        xs, counts = changed_entries(ordered, ctx.params.global_.epsilon)
        divisor = counts.clamp_min_(1.0)  # x / 1 is x: an entry one expert changed keeps its delta whole
        total = xs[0].div_(divisor)
        for x in xs[1:]:
            total.add_(x.div_(divisor))
        return total.add_(base)  # == base + Σ (addition commutes)


@register
class RamPlusTlDef(OperatorDef):
    """RAM+ tensor-local, counted over whole tensors; xi_j and c_j as ``ram``'s:

    Si = #{j : xi_j != 0, c_j > 1},  Ui = #{j : xi_j != 0, c_j = 1}
    ρi = Si / max(Ui, e) (0 when Si = 0),  λi = 1 + r min(ρi, α)  (float64)
    out_j = B_j + Σi (xi_j λi if c_j = 1, else xi_j / c_j)
    """

    name = "ramplus_tl"
    summary = "RAM, each expert's unique entries scaled by 1 + r min(shared/unique, alpha) per tensor"
    global_params = ReinforcedThreshold
    streaming = False
    budget_note = (
        "ramplus_tl merges whole tensors, each from every expert or not at all (then it keeps the "
        "base's values); an expert tensor a delta-store plan leaves unread takes no part in it"
    )

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # Δ = 0 changes no entry and counts for none

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        ordered = [deltas[i] for i in ctx.order]
        if base.numel() == 0 or all(d is None for d in ordered):
            return base.clone()
        g = ctx.params.global_
        xs, counts = changed_entries(ordered, g.epsilon)
        alone = counts == 1
        divisor = counts.clamp_min_(1.0)
        total: Tensor | None = None
        for x in xs:
            nonzero = x != 0
            unique = int((nonzero & alone).sum())
            shared = int(nonzero.sum()) - unique
            ratio = 0.0 if shared == 0 else math.inf if max(unique, g.epsilon) == 0 else shared / max(unique, g.epsilon)
            term = torch.where(alone, x * (1.0 + g.r * min(max(ratio, 0.0), g.alpha)), x / divisor)
            total = term if total is None else total.add_(term)
        assert total is not None  # xs is not empty
        return total.add_(base)

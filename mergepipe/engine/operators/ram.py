"""RAM, Reinforced Agent Merging (arXiv:2601.13572), and RAM+ tensor-local
(``ramplus_tl``): keep what each expert changed; where several experts
changed an entry, average them; RAM+ also scales up each expert's entries
that no other expert changed.

With deltas Δi and epsilon e, per entry j:

    xi_j   = Δi_j if |Δi_j| > e, else 0          (the entries expert i changed)
    c_j    = #{i : xi_j != 0}                     (how many experts changed j)
    ram:         out_j = B_j + Σi xi_j / max(c_j, 1)          (experts in id order)

so an entry changed by one expert takes its delta whole, one changed by
several their mean, one changed by none stays at the base. ``ramplus_tl``
gives each expert one factor per tensor from how much of what it changed it
shares with others:

    Si = #{j : xi_j != 0, c_j > 1},   Ui = #{j : xi_j != 0, c_j = 1}
    ρi = Si / max(Ui, e)   (0 when Si = 0),   λi = 1 + r · min(ρi, α)   (float64)
    ramplus_tl:  out_j = B_j + Σi (xi_j · λi if c_j = 1, else xi_j / c_j)

mergekit's ``ram`` and ``ramplus_tl``: ``base_model`` is MergePipe's base
(required; a base also listed under ``models`` is skipped, as mergekit does),
the other models are the experts; ``parameters: {epsilon}`` (``ram``) or
``{r, alpha, epsilon}`` (``ramplus_tl``) are global, with mergekit's
defaults (e = 1e-5, r = 0.1, α = 0.2). There are no per-model parameters.

An expert block that is not read (``None``) takes no part: Δ = 0 changes no
entry and counts for none. ``ram`` is element-wise and streams block by
block: an unread block is a block whose entries the read experts alone
decide. ``ramplus_tl`` needs whole-tensor counts, so it is tensor-level:
the planner reads a tensor from every expert or not at all.

Intentional differences from mergekit 0.1.5 (``ram_merge``,
``ramplus_tl_merge``): experts are summed in id order (mergekit: in the
order listed), and λi is computed in float64 (mergekit: fp32), so results
agree to fp32 rounding. With ``epsilon: 0`` an expert that leaves a tensor
unchanged has Si = Ui = 0: ρi = 0 here, where mergekit divides 0 by 0 and
writes NaN for the whole tensor.
"""

from __future__ import annotations

import math

import torch

from mergepipe.engine.operators.context import BlockContext


def changed_entries(deltas: list[torch.Tensor | None], epsilon: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(xi, c)`` of the deltas that were read (None left out): each delta with its entries of
    |Δ| <= epsilon zeroed, and per entry the number of experts that changed it, as fp32. A NaN is
    kept (NaN <= e is false), so that ``registry.merge`` finds it in the output."""
    xs = [torch.where(d.abs() <= epsilon, 0.0, d) for d in deltas if d is not None]
    counts = torch.zeros_like(xs[0])
    for x in xs:
        counts.add_(x != 0)
    return xs, counts


def ram(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    ordered = [deltas[i] for i in ctx.order]
    if all(d is None for d in ordered):
        return base.clone()
    xs, counts = changed_entries(ordered, ctx.global_params.epsilon)
    divisor = counts.clamp_min_(1.0)  # x / 1 is x: an entry one expert changed keeps its delta whole
    total = xs[0].div_(divisor)
    for x in xs[1:]:
        total.add_(x.div_(divisor))
    return total.add_(base)  # == base + Σ (addition commutes)


def reinforcement(shared: int, unique: int, r: float, alpha: float, epsilon: float) -> float:
    """λi = 1 + r · min(ρi, α), ρi = Si / max(Ui, epsilon) (0 when Si = 0, α when the divisor is 0)."""
    divisor = max(unique, epsilon)
    ratio = 0.0 if shared == 0 else math.inf if divisor == 0 else shared / divisor
    return 1.0 + r * min(max(ratio, 0.0), alpha)


def ramplus_tl(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    ordered = [deltas[i] for i in ctx.order]
    if base.numel() == 0 or all(d is None for d in ordered):
        return base.clone()
    g = ctx.global_params
    xs, counts = changed_entries(ordered, g.epsilon)
    alone = counts == 1
    divisor = counts.clamp_min_(1.0)
    total: torch.Tensor | None = None
    for x in xs:
        nonzero = x != 0
        unique = int((nonzero & alone).sum())
        factor = reinforcement(int(nonzero.sum()) - unique, unique, g.r, g.alpha, g.epsilon)
        term = torch.where(alone, x * factor, x / divisor)
        total = term if total is None else total.add_(term)
    assert total is not None
    return total.add_(base)

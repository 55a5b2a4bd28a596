"""The points the spherical means (nuslerp, multislerp, karcher) run on.

mergekit interpolates either task vectors (with a ``base_model``: the points
are ``Ei - B`` and the result is added back to B) or the models themselves
(without one: the points are the models, the origin is 0). MergePipe always
has a base B and gets deltas ``Δi = Ei - B``; in the second form the base is
one of the models (the config's first), so the points are B itself, with
the global ``base_weight``, and ``B + Δi``. Either way the points come in
summation order: the base first where it is one, then the experts by id
(``BlockContext.order``), so the bits do not depend on the order experts
were listed in.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators.context import BlockContext


def unchanged(deltas: list[torch.Tensor | None]) -> bool:
    """Whether every delta is absent or zero: the mean of copies of the base is the base, exactly
    (the same bytes the planner copies where no expert changed a tensor)."""
    return all(d is None or not bool(d.any()) for d in deltas)


def task_vectors(
    base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext
) -> tuple[list[torch.Tensor], list[float]]:
    """The experts' deltas (an unread one is 0) and their weights, in id order."""
    points = [torch.zeros_like(base) if d is None else d for d in (deltas[i] for i in ctx.order)]
    return points, [ctx.expert_params[i].weight for i in ctx.order]


def models(
    base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext, base_weight: float
) -> tuple[list[torch.Tensor], list[float]]:
    """The base and every expert ``B + Δi`` (an unread one is the base), with their weights."""
    points = [base] + [base if d is None else base + d for d in (deltas[i] for i in ctx.order)]
    return points, [base_weight] + [ctx.expert_params[i].weight for i in ctx.order]

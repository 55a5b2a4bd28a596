"""Sparsification shared by several operators: magnitude trims and rescaling.

Magnitude trim (TIES, breadcrumbs): for a fraction f of a tensor of n
elements keep exactly ``k = max(1, int(f * n))`` entries of largest |Δ|, ties
broken by position (the first k of a stable descending sort). A block
applies it with the tensor's TrimThreshold ``(tau, p)``: keep ``|Δj| > tau``
or ``|Δj| == tau and j <= p``. The catalog precomputes thresholds for a grid
of densities; a missing one is computed here from the whole tensor with the
same function the catalog uses, so both paths keep the same entries.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mergepipe.catalog.thresholds import keep_mask, trim_thresholds
from mergepipe.engine.operators.base import BlockContext, require_finite
from mergepipe.errors import EngineError

#: mergekit leaves the L1-rescaled delta unscaled when either norm is below this.
L1_EPS = 1e-7


def magnitude_keeps(
    abs_block: torch.Tensor, ctx: BlockContext, expert: int, fractions: Sequence[float]
) -> list[torch.Tensor]:
    """Keep masks of ``abs_block`` (|Δ| of expert ``expert``) for each fraction."""
    thresholds = [ctx.threshold(expert, f) for f in fractions]
    missing = [f for f, t in zip(fractions, thresholds) if t is None]
    if missing:
        if not (ctx.row_start == 0 and abs_block.numel() == ctx.numel):
            raise EngineError(
                f"no trim threshold at density {missing} for tensor {ctx.tensor_name!r} of expert "
                f"{ctx.expert_ids[expert]!r}, and only a block was given; the engine must pass the "
                "whole tensor when streams_with() is False (run `mergepipe analyze` to store thresholds)"
            )
        require_finite(abs_block, f"the delta of expert {ctx.expert_ids[expert]!r}", ctx)
        computed = dict(zip(missing, trim_thresholds(abs_block.reshape(-1), missing)))
        thresholds = [computed[f] if t is None else t for f, t in zip(fractions, thresholds)]
    return [keep_mask(abs_block, ctx.flat_start, t) for t in thresholds]


def rescale_l1(delta: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept * ||delta||_1 / ||kept||_1`` (sums in float64), as mergekit's
    ``rescale: true``; unscaled when either norm is below ``L1_EPS``.
    Needs whole tensors: the norms are per tensor."""
    before = float(delta.abs().sum(dtype=torch.float64))
    after = float(kept.abs().sum(dtype=torch.float64))
    if before < L1_EPS or after < L1_EPS:
        return kept
    return kept * (before / after)

"""TIES merging (Yadav et al. 2023, arXiv:2306.01708).

Per expert i and tensor of n elements, with density di:

    trim:   keep exactly k = max(1, int(di * n)) entries of largest |Δi|, ties
            at the threshold broken by position (the first k of a stable
            descending sort); the rest become 0          -> xi
    elect:  σ = sign(Σi wi xi), 0 -> +
    merge:  m = Σ over agreeing i of wi xi, divided by Σ of agreeing wi
            (normalize, the default), times λ
    out  =  B + m

(see ``_combine.sign_consensus`` for the exact arithmetic). Block by block
the trim uses the catalog's TrimThreshold (tau, p) for di: keep |Δ| > tau, or
|Δ| == tau at flat index <= p; so any block split gives the whole-tensor
result bit for bit. A density without a stored threshold falls back to a
tensor-level computation (``streams_with`` returns False).

Intentional differences from mergekit 0.1.5 (``sparsify.magnitude`` +
``get_mask``): mergekit picks the k survivors with a non-stable argsort, so
which entries equal to tau survive is arbitrary (with bf16 checkpoints many
|Δ| tie); here it is the first ones in row-major order. ``rescale`` (an L1
rescale mergekit allows after a magnitude trim) and ``int8_mask`` are not
accepted. Weights must be >= 0.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._combine import sign_consensus
from mergepipe.engine.operators._sparsify import magnitude_trim
from mergepipe.engine.operators.context import BlockContext


def trim(delta: torch.Tensor, ctx: BlockContext, expert: int) -> torch.Tensor:
    """Expert ``expert``'s delta block with all but its top-k entries zeroed."""
    fractions = ctx.definition.needs_thresholds(ctx.expert_params[expert])
    if not fractions:
        return delta
    (fraction,) = fractions
    return magnitude_trim(delta, ctx, expert, fraction)


def ties(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    terms = [
        (ctx.expert_params[i].weight, None if (delta := deltas[i]) is None else trim(delta, ctx, i)) for i in ctx.order
    ]
    g = ctx.global_params
    return sign_consensus(base, terms, g.normalize, g.lambda_, owned=ctx.owns_deltas)

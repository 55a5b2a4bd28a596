"""What DARE, DELLA, breadcrumbs and TIES share: sparsify each expert's Δ on
its own, then combine.

Magnitude trim (TIES, breadcrumbs): for a fraction f of a tensor of n
elements keep exactly ``k = max(1, int(f * n))`` entries of largest |Δ|, ties
broken by position (the first k of a stable descending sort). A block
applies it with the tensor's TrimThreshold ``(tau, p)``: keep ``|Δj| > tau``
or ``|Δj| == tau and j <= p``. The catalog precomputes thresholds for a grid
of densities; a missing one is computed here from the whole tensor with the
same function analysis uses, so both paths keep the same entries.

``sparse_sum`` (dare_linear, della_linear, breadcrumbs) adds the sparsified
deltas with the definition's linear coefficients; ``sparse_consensus``
(their ``*_ties`` variants, della) replaces the sum by TIES sign election
and disjoint mean.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from mergepipe.analysis.stats import keep_mask, trim_thresholds, trimmed
from mergepipe.engine.operators._combine import sign_consensus, weighted_sum
from mergepipe.engine.operators.context import BlockContext, require_finite
from mergepipe.errors import EngineError
from mergepipe.spec.operators import SparsifyThenSumDef
from mergepipe.spec.operators import TrimThreshold

#: mergekit leaves the L1-rescaled delta unscaled when either norm is below this.
L1_EPS = 1e-7

#: ``sparsify(delta, ctx, expert)``: expert ``expert``'s sparsified delta block.
Sparsify = Callable[[torch.Tensor, BlockContext, int], torch.Tensor]


def magnitude_keeps(
    abs_block: torch.Tensor, ctx: BlockContext, expert: int, fractions: Sequence[float]
) -> list[torch.Tensor]:
    """Keep masks of ``abs_block`` (|Δ| of expert ``expert``) for each fraction."""
    found = [ctx.threshold(expert, f) for f in fractions]
    missing = [f for f, t in zip(fractions, found) if t is None]
    computed: dict[float, TrimThreshold] = {}
    if missing:
        if not ctx.is_whole(abs_block):
            raise EngineError(
                f"no trim threshold at density {missing} for tensor {ctx.tensor_name!r} of expert "
                f"{ctx.expert_ids[expert]!r}, and only a block was given; the engine must pass the "
                "whole tensor when streams_with() is False (run `mergepipe analyze` to store thresholds)"
            )
        require_finite(abs_block, f"the delta of expert {ctx.expert_ids[expert]!r}", ctx)
        computed = dict(zip(missing, trim_thresholds(abs_block.reshape(-1), missing)))
    thresholds = [computed[f] if t is None else t for f, t in zip(fractions, found)]
    return [keep_mask(abs_block, ctx.flat_start, t) for t in thresholds]


def magnitude_trim(delta: torch.Tensor, ctx: BlockContext, expert: int, fraction: float) -> torch.Tensor:
    """``delta`` with all but the tensor's top ``fraction`` by |Δ| zeroed: one
    vectorised pass with the catalog's threshold (``thresholds.trimmed``),
    the mask path when the threshold must be computed here."""
    threshold = ctx.threshold(expert, fraction)
    if threshold is None:
        (keep,) = magnitude_keeps(delta.abs(), ctx, expert, [fraction])
        return delta * keep
    return trimmed(delta, ctx.flat_start, threshold, in_place=ctx.owns_deltas)


def rescale_l1(delta: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept * ||delta||_1 / ||kept||_1`` (sums in float64), as mergekit's
    ``rescale: true``; unscaled when either norm is below ``L1_EPS``.
    Needs whole tensors: the norms are per tensor."""
    before = float(delta.abs().sum(dtype=torch.float64))
    after = float(kept.abs().sum(dtype=torch.float64))
    if before < L1_EPS or after < L1_EPS:
        return kept
    return kept * (before / after)


def l1_if_asked(delta: torch.Tensor, kept: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
    """With ``rescale: l1`` scale the survivors to the L1 norm of the whole Δ
    (mergekit's rescale; needs the whole tensor), else return them as they are."""
    if ctx.global_params.rescale != "l1":
        return kept
    if not ctx.is_whole(delta):
        raise ValueError(f"{ctx.definition.name} with rescale l1 is tensor-level: pass the whole tensor")
    return rescale_l1(delta, kept)


def _sparsified(deltas: list[torch.Tensor | None], ctx: BlockContext, sparsify: Sparsify) -> list[torch.Tensor | None]:
    return [None if d is None else sparsify(d, ctx, i) for i, d in enumerate(deltas)]


def sparse_sum(
    base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext, sparsify: Sparsify
) -> torch.Tensor:
    """``B + Σ ci xi`` over the sparsified deltas, ``ci`` from the definition."""
    definition = ctx.definition
    assert isinstance(definition, SparsifyThenSumDef)  # dare_linear, della_linear and breadcrumbs call this
    coefs = definition.coefficients(ctx.params, ctx.tensor_name)
    xs = _sparsified(deltas, ctx, sparsify)
    return weighted_sum(base, [(coefs[i], xs[i]) for i in ctx.order])


def sparse_consensus(
    base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext, sparsify: Sparsify
) -> torch.Tensor:
    """TIES sign election and disjoint mean over the sparsified deltas."""
    xs = _sparsified(deltas, ctx, sparsify)
    terms = [(ctx.expert_params[i].weight, xs[i]) for i in ctx.order]
    g = ctx.global_params
    return sign_consensus(base, terms, g.normalize, g.lambda_, owned=ctx.owns_deltas)

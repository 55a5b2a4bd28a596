"""Model breadcrumbs (Davari & Belilovsky 2023, arXiv:2312.06795): ``breadcrumbs`` and ``breadcrumbs_ties``."""

from __future__ import annotations

from typing import Annotated

from mergepipe.spec.operators.base import BlockContext, Density, ParamDef, Params, ScaledSum, Tensor, Weight, register
from mergepipe.spec.operators.kernels import SignElection, Sparsified, magnitude_keeps

GAMMA = ParamDef(
    "gamma", "Breadcrumbs: fraction of the largest delta entries dropped", "[0, 1)", scope="expert", flag=True
)


class Crumbs(Params):
    weight: Weight = 1.0
    density: Density = 1.0
    gamma: Annotated[float, GAMMA] = 0.01


def band_fractions(gamma: float, density: float) -> tuple[float, float]:
    """``(top, outer)``: the kept band lies between these two trim fractions."""
    return min(gamma, 1.0 - density), min(gamma + density, 1.0)


@register
class BreadcrumbsDef(Sparsified):
    """Drop the largest and the smallest entries of each delta, then a weighted sum or TIES' sign election.
    Per expert i with density d and gamma g (d < 1), on a tensor of n entries:

        top  = min(g, 1 - d),   outer = min(g + d, 1)
        keep = ranks [int(top n), max(1, int(outer n))) of a stable descending sort of |Δi|
             = keep_mask(outer) & ~keep_mask(top), the catalog's TrimThresholds at both fractions
               (nothing dropped at the top when int(top n) = 0)
        xi   = Δi ⊙ keep
        breadcrumbs:      out = B + Σi ci xi,  ci = λ wi (/ Σw with normalize)
        breadcrumbs_ties: out = B + sign_consensus(wi, xi, normalize, λ)

    ``d = 1`` keeps everything. It streams when the catalog has both thresholds, else merges whole tensors.
    """

    name = "breadcrumbs"
    summary = "drop the largest (gamma) and smallest delta entries, keep a density band, sum"
    expert_params = Crumbs
    global_params = ScaledSum

    def needs_thresholds(self, expert: Crumbs) -> tuple[float, ...]:
        if expert.density >= 1.0:
            return ()
        return tuple(f for f in band_fractions(expert.gamma, expert.density) if 0.0 < f < 1.0)

    def sparsify(self, delta: Tensor, ctx: BlockContext, expert: int) -> Tensor:
        params = ctx.params.experts[expert]
        if params.density >= 1.0:
            return delta
        top, outer = band_fractions(params.gamma, params.density)
        drop_top = int(top * ctx.numel) >= 1
        fractions = ([outer] if outer < 1.0 else []) + ([top] if drop_top else [])
        if not fractions:
            return delta
        masks = magnitude_keeps(delta.abs(), ctx, expert, fractions)
        keep = masks[0] if outer < 1.0 else None
        if drop_top:
            keep = ~masks[-1] if keep is None else keep & ~masks[-1]
        assert keep is not None  # fractions is not empty: outer < 1 or drop_top
        return delta * keep


@register
class BreadcrumbsTiesDef(SignElection, BreadcrumbsDef):
    name = "breadcrumbs_ties"
    summary = "breadcrumbs' band, then TIES sign election"

"""Model breadcrumbs (Davari & Belilovsky 2023, arXiv:2312.06795):
drop the largest and the smallest entries of each delta, then task
arithmetic (``breadcrumbs``) or TIES sign election (``breadcrumbs_ties``).

Per expert i and tensor of n elements, with density d and gamma g (d < 1):

    top   = min(g, 1 - d)           outer = min(g + d, 1)
    keep  = entries ranked in [int(top * n), max(1, int(outer * n)))  of a
            stable descending sort of |Δi| (ties broken by position)
          = keep_mask(outer) & ~keep_mask(top)      with the catalog's
            TrimThresholds at fractions ``top`` and ``outer``; no entry is
            dropped at the top when int(top * n) == 0
    xi    = Δi ⊙ keep
    breadcrumbs:      out = B + Σi ci xi,  ci = λ wi (/ Σw with normalize)
    breadcrumbs_ties: out = B + sign_consensus(wi, xi, normalize, λ)

``d = 1`` keeps everything (as mergekit). Both streams when the catalog has
both thresholds, otherwise runs at tensor level.

Intentional differences from mergekit 0.1.5 (``magnitude_outliers``):
mergekit keeps ranks [int(g n), int(g n) + int(d n)); here the band ends at
int((g + d) n), which may keep one entry more when the fractional parts of
g n and d n add up to >= 1 (it makes the band a pair of per-tensor density
thresholds the catalog can precompute); at least one entry is kept when the
top band is empty (as TIES); ties at both cut-offs are broken by position
(mergekit's argsort is not stable). Earlier mergekit versions dropped every
entry when int(g n) == 0 (a slice ``[n_bot:-0]``); that bug is not
reproduced. ``rescale`` is not accepted; ``breadcrumbs_ties`` needs weights
>= 0.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._sparsify import magnitude_keeps, sparse_consensus, sparse_sum
from mergepipe.engine.operators.context import BlockContext
from mergepipe.spec.operators import band_fractions


def sparsify(delta: torch.Tensor, ctx: BlockContext, expert: int) -> torch.Tensor:
    """Keep the band of one delta block between the two trim fractions."""
    params = ctx.expert_params[expert]
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
        above_band = masks[-1]
        keep = ~above_band if keep is None else keep & ~above_band
    assert keep is not None  # fractions is not empty: outer < 1 or drop_top
    return delta * keep


def breadcrumbs(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    return sparse_sum(base, deltas, ctx, sparsify)


def breadcrumbs_ties(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    return sparse_consensus(base, deltas, ctx, sparsify)

"""DELLA (Deep et al. 2024, arXiv:2406.11617): MAGPRUNE, a random drop whose
keep probability grows with the entry's magnitude rank within its row, then
rescale, then TIES sign election (``della``) or task arithmetic
(``della_linear``).

Per expert i with density d and epsilon e (d < 1), for each row of the
tensor (a row is everything after the first dimension; a 0-d or 1-D tensor
is one row) of C entries:

    pos_j   = position of entry j in a stable descending sort of |Δi| in its
              row (0 = largest; ties: the earlier entry ranks higher)
    r_j     = (C - 1 - pos_j) / (C - 1)        in [0, 1]  (r = 1/2 if C = 1)
    p_j     = (d - e) + 2 e r_j                keep probability (float64)
    keep_j  = u_j < p_j,   u_j = ElementRng(seed, expert, tensor).uniform(j)
    xi_j    = Δi_j / fp32(p_j) if keep_j       (rescale: inverse, the default:
                                                DELLA's 1/(1 - drop prob))
            = Δi_j if keep_j                   (rescale: none)
            rescale: l1 -> xi = (Δi ⊙ keep) * ||Δi||_1 / ||Δi ⊙ keep||_1 per
                           tensor (mergekit's ``rescale: true``; tensor-level)
    della:        out = B + sign_consensus(wi, xi, normalize, λ)
    della_linear: out = B + Σi ci xi,   ci = λ wi (/ Σw with normalize)

Requires 0 < d - e and d + e < 1 (unless d = 1: no drop, as mergekit).
Blocks are whole rows, so ranks need no per-tensor statistic: it streams
(except with rescale l1).

Intentional differences from mergekit 0.1.5 (``della_magprune``): ties in
|Δ| are ranked by position (mergekit's double argsort is not stable); a
one-entry row gets r = 1/2 (mergekit divides 0 by 0); tensors with more than
two dimensions are ranked over whole rows (mergekit ranks along dim 1 only);
the random source is the element-addressed generator (mergekit uses the
global torch generator); the default rescale is the paper's 1/p (mergekit
defaults to L1). ``della`` needs weights >= 0.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._sparsify import l1_if_asked, sparse_consensus, sparse_sum
from mergepipe.engine.operators.context import BlockContext
from mergepipe.spec.operators import DellaLinearDef


def position_probabilities(
    cols: int, density: float, epsilon: float, device: torch.device | None = None
) -> torch.Tensor:
    """float64 keep probability of the entry at each position 0..cols-1 of a
    row sorted by descending magnitude."""
    if cols == 1:
        rank = torch.full((1,), 0.5, dtype=torch.float64, device=device)
    else:
        rank = (cols - 1 - torch.arange(cols, dtype=torch.float64, device=device)) / (cols - 1)
    return (density - epsilon) + (2.0 * epsilon) * rank


def sparsify(delta: torch.Tensor, ctx: BlockContext, expert: int) -> torch.Tensor:
    """MAGPRUNE: random drop with rank-dependent keep probability, then rescale."""
    params = ctx.expert_params[expert]
    density, epsilon = params.density, params.epsilon
    if density >= 1.0 or delta.numel() == 0:
        return delta
    definition = ctx.definition
    assert isinstance(definition, DellaLinearDef)  # the registry runs this for della and della_linear only
    definition.check_epsilon([params], repr(ctx.tensor_name))
    cols = ctx.row_numel
    rows = delta.reshape(-1, cols)
    # Work in each row's sorted order, where the keep probability depends
    # on the position only: gather there, scatter the result back.
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
    prob = position_probabilities(cols, density, epsilon, delta.device)
    # u < p  <=>  53-bit integer < ceil(p * 2**53), exactly (see rng.py)
    limit = torch.ceil(prob * 2.0**53).to(torch.int64)
    bits = ctx.rngs[expert].bits(ctx.flat_start, delta.numel(), device=delta.device).view(rows.shape)
    keep = bits.gather(1, order) < limit
    values = rows.gather(1, order)
    if ctx.global_params.rescale == "inverse":
        values = values.div_(prob.to(torch.float32))
    kept = torch.empty_like(rows).scatter_(1, order, values.mul_(keep)).view(delta.shape)
    return l1_if_asked(delta, kept, ctx)


def della_linear(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    return sparse_sum(base, deltas, ctx, sparsify)


def della(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    return sparse_consensus(base, deltas, ctx, sparsify)

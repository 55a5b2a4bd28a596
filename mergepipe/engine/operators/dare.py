"""DARE (Yu et al. 2024, arXiv:2311.03099): random drop and rescale, then
task arithmetic (``dare_linear``, alias ``dare``) or TIES sign election
(``dare_ties``).

Per expert i with density di, for element j of the tensor:

    keep_j  = u_j < di,   u_j = ElementRng(seed, expert, tensor).uniform(j)
    xi_j    = Δi_j / di   if keep_j      (rescale: inverse, the default: the
                                          DARE paper's 1/(1-p) with p = 1-di)
            = Δi_j        if keep_j      (rescale: none)
            = 0           otherwise
            rescale: l1  -> xi = (Δi ⊙ keep) * ||Δi||_1 / ||Δi ⊙ keep||_1 per
                            tensor (mergekit's ``rescale: true``; tensor-level)
    dare_linear: out = B + Σi ci xi,  ci = λ wi (/ Σw with normalize)
    dare_ties:   out = B + sign_consensus(wi, xi, normalize, λ)

``di = 1`` keeps everything without rescaling (as mergekit). The mask depends
only on (seed, expert id, tensor name, element index): not on block size,
thread or expert order.

Intentional differences from mergekit 0.1.5: the random source (mergekit
draws ``torch.bernoulli`` from the global torch generator, so its masks are
not reproducible across block sizes or runs); the default rescale (mergekit
defaults to the L1 rescale, here the paper's 1/density, which streams); L1
sums are taken in float64. ``dare_ties`` needs weights >= 0.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._sparsify import l1_if_asked, sparse_consensus, sparse_sum
from mergepipe.engine.operators.context import BlockContext


def sparsify(delta: torch.Tensor, ctx: BlockContext, expert: int) -> torch.Tensor:
    """Random drop (keep with probability density) and rescale of one delta block."""
    density = ctx.expert_params[expert].density
    if density >= 1.0:
        return delta
    keep = ctx.rngs[expert].below(ctx.flat_start, delta.numel(), density, device=delta.device).view(delta.shape)
    # masks multiply rather than torch.where: same values (inputs are
    # finite), several times faster on CPU
    if ctx.global_params.rescale == "inverse":
        # Divide by a tensor on delta's device, not by the Python float: CUDA
        # turns division by a CPU scalar into a multiply by its reciprocal,
        # which differs from the CPU's true division in the last bit.
        return delta.div(delta.new_full((), density)).mul_(keep)
    return l1_if_asked(delta, delta * keep, ctx)


def dare_linear(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    return sparse_sum(base, deltas, ctx, sparsify)


def dare_ties(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    return sparse_consensus(base, deltas, ctx, sparsify)

"""DARE (Yu et al. 2024, arXiv:2311.03099): ``dare_linear`` (alias ``dare``) and ``dare_ties``."""

from __future__ import annotations

import math

from mergepipe.spec.operators.base import BlockContext, Density, Params, Tensor, Weight, register
from mergepipe.spec.operators.kernels import RescaledSum, SignElection, Sparsified


class Dropped(Params):
    weight: Weight = 1.0
    density: Density = 1.0


@register
class DareLinearDef(Sparsified):
    """Random drop and rescale, then a weighted sum or TIES' sign election. Per expert i with density di,
    element j:

        keep_j = u_j < di,   u_j: element j's uniform (``ElementRng``)
        xi_j   = Δi_j / di if keep_j, else 0      (rescale: inverse, the default: the paper's 1/(1-p))
                 Δi_j if keep_j, else 0           (rescale: none)
                 rescale l1: (Δi ⊙ keep) ||Δi||_1 / ||Δi ⊙ keep||_1 per tensor (mergekit's ``rescale: true``)
        dare_linear: out = B + Σi ci xi,  ci = λ wi (/ Σw with normalize)
        dare_ties:   out = B + sign_consensus(wi, xi, normalize, λ)

    ``di = 1`` keeps everything unscaled. The mask depends only on (seed, expert, tensor, element): not on block
    size, thread or expert order.
    """

    name = "dare_linear"
    summary = "drop delta entries at random (keep density), rescale, sum"
    expert_params = Dropped
    global_params = RescaledSum
    random = True

    def sparsify(self, delta: Tensor, ctx: BlockContext, expert: int) -> Tensor:
        density = ctx.params.experts[expert].density
        if density >= 1.0:
            return delta
        bits = ctx.rngs[expert].bits(ctx.flat_start, delta.numel(), device=delta.device).view(delta.shape)
        keep = bits < math.ceil(math.ldexp(density, 53))  # u = bits 2**-53 < density, exactly
        if ctx.params.global_.rescale == "inverse":
            # divided by a tensor on delta's device: CUDA turns division by a CPU scalar into a multiply by
            # its reciprocal, which differs from true division in the last bit
            return delta.div(delta.new_full((), density)).mul_(keep)
        return self.rescaled(delta, delta * keep, ctx)  # masks multiply: inputs are finite


@register
class DareTiesDef(SignElection, DareLinearDef):
    name = "dare_ties"
    summary = "DARE's random drop, then TIES sign election"

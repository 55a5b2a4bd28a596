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

from typing import Any, Mapping, Sequence

import torch

from mergepipe.engine.operators._sparse_base import SparsifyThenConsensus, SparsifyThenSum
from mergepipe.engine.operators.base import BlockContext


class DareLinear(SparsifyThenSum):
    name = "dare_linear"
    expert_params = ("weight", "density")
    global_params = ("lambda", "normalize", "rescale")
    default_overrides = {"normalize": False, "rescale": "inverse"}

    def streams_with(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], thresholds_available: bool
    ) -> bool:
        return global_["rescale"] != "l1"

    @staticmethod
    def _gain(expert_params: Mapping[str, Any], global_: Mapping[str, Any]) -> float:
        """Largest factor the rescale applies to a kept entry."""
        density = expert_params["density"]
        return 1.0 / density if global_["rescale"] == "inverse" and density < 1.0 else 1.0

    def sparsify(self, delta: torch.Tensor, ctx: BlockContext, expert: int) -> torch.Tensor:
        density = ctx.expert_params[expert]["density"]
        if density >= 1.0:
            return delta
        rescale = ctx.global_params["rescale"]
        keep = ctx.rngs[expert].below(ctx.flat_start, delta.numel(), density).view(delta.shape)
        # masks multiply rather than torch.where: same values (inputs are
        # finite), several times faster on CPU
        if rescale == "inverse":
            return (delta / density).mul_(keep)
        kept = delta * keep
        return self._l1_if_asked(delta, kept, ctx)


class DareTies(SparsifyThenConsensus, DareLinear):
    name = "dare_ties"
    default_overrides = {"normalize": False, "rescale": "inverse"}


DARE_LINEAR = DareLinear()
DARE_TIES = DareTies()

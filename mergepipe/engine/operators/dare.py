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

import math
from typing import Any, Mapping, Sequence

import torch

from mergepipe.engine.operators._combine import linear_coefficients, sign_consensus, weighted_sum
from mergepipe.engine.operators._sparsify import rescale_l1
from mergepipe.engine.operators.base import BlockContext, Operator


class DareLinear(Operator):
    name = "dare_linear"
    error_bound = "separable"
    expert_params = ("weight", "density")
    global_params = ("lambda", "normalize", "rescale")
    default_overrides = {"normalize": False, "rescale": "inverse"}

    def streams_with(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], thresholds_available: bool
    ) -> bool:
        return global_["rescale"] != "l1"

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        self._linear_coefficients(per_expert, global_, tensor_name)

    def _linear_coefficients(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str = "this tensor"
    ) -> list[float]:
        weights = [p["weight"] for p in per_expert]
        return linear_coefficients(weights, global_["lambda"], global_["normalize"], self.name, tensor_name)

    def coefficient(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> list[float]:
        if global_["rescale"] == "l1":
            return [math.inf] * len(per_expert)
        coefs = self._linear_coefficients(per_expert, global_)
        return [abs(c) * self._gain(p, global_) for c, p in zip(coefs, per_expert)]

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
        if rescale == "l1":
            if not self._is_whole(delta, ctx):
                raise ValueError(f"{self.name} with rescale l1 is tensor-level: pass the whole tensor")
            return rescale_l1(delta, kept)
        return kept

    def _sparsified(self, deltas: list[torch.Tensor | None], ctx: BlockContext) -> list[torch.Tensor | None]:
        return [None if d is None else self.sparsify(d, ctx, i) for i, d in enumerate(deltas)]

    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        coefs = self._linear_coefficients(ctx.expert_params, ctx.global_params, ctx.tensor_name)
        xs = self._sparsified(deltas, ctx)
        return weighted_sum(base, [(coefs[i], xs[i]) for i in ctx.order])


class DareTies(DareLinear):
    name = "dare_ties"
    error_bound = "consensus"
    default_overrides = {"normalize": False, "rescale": "inverse"}
    nonnegative_weights = True

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        pass  # normalize divides by the agreeing weights: no sum to check

    def coefficient(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> list[float]:
        if global_["rescale"] == "l1":
            return [math.inf] * len(per_expert)
        lam = abs(global_["lambda"])
        scale = [1.0 if global_["normalize"] else abs(p["weight"]) for p in per_expert]
        return [lam * s * self._gain(p, global_) for s, p in zip(scale, per_expert)]

    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        xs = self._sparsified(deltas, ctx)
        terms = [(ctx.expert_params[i]["weight"], xs[i]) for i in ctx.order]
        return sign_consensus(base, terms, ctx.global_params["normalize"], ctx.global_params["lambda"])


DARE_LINEAR = DareLinear()
DARE_TIES = DareTies()

"""The shape DARE, DELLA and breadcrumbs share: sparsify each expert's Δ on
its own, then combine.

``SparsifyThenSum`` (dare_linear, della_linear, breadcrumbs) sums the
sparsified deltas with linear coefficients; ``SparsifyThenConsensus`` (their
``*_ties`` variants) replaces the sum by TIES sign election and disjoint mean.
A subclass supplies ``sparsify`` and, if its rescaling can enlarge an entry,
``_gain`` (the largest factor applied to a kept entry) for the error bound.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from mergepipe.engine.operators._combine import linear_coefficients, sign_consensus, weighted_sum
from mergepipe.engine.operators._sparsify import rescale_l1
from mergepipe.engine.operators.base import BlockContext, Operator


class SparsifyThenSum(Operator):
    """Per-expert sparsification, then ``B + Σ ci xi`` (ci = λ wi, / Σw with normalize)."""

    error_bound = "separable"

    def sparsify(self, delta: torch.Tensor, ctx: BlockContext, expert: int) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _gain(expert_params: Mapping[str, Any], global_: Mapping[str, Any]) -> float:
        """Largest factor the rescaling applies to a kept entry (1: none)."""
        return 1.0

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        self._linear_coefficients(per_expert, global_, tensor_name)

    def _linear_coefficients(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str = "this tensor"
    ) -> list[float]:
        weights = [p["weight"] for p in per_expert]
        return linear_coefficients(weights, global_["lambda"], global_["normalize"], self.name, tensor_name)

    def coefficient(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> list[float]:
        if global_.get("rescale") == "l1":  # a per-tensor factor: no per-element bound
            return [math.inf] * len(per_expert)
        coefs = self._linear_coefficients(per_expert, global_)
        return [abs(c) * self._gain(p, global_) for c, p in zip(coefs, per_expert)]

    def _l1_if_asked(self, delta: torch.Tensor, kept: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """With ``rescale: l1`` scale the survivors to the L1 norm of the
        whole Δ (mergekit's rescale; needs the whole tensor), else as is."""
        if ctx.global_params.get("rescale") != "l1":
            return kept
        if not self._is_whole(delta, ctx):
            raise ValueError(f"{self.name} with rescale l1 is tensor-level: pass the whole tensor")
        return rescale_l1(delta, kept)

    def _sparsified(self, deltas: list[torch.Tensor | None], ctx: BlockContext) -> list[torch.Tensor | None]:
        return [None if d is None else self.sparsify(d, ctx, i) for i, d in enumerate(deltas)]

    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        coefs = self._linear_coefficients(ctx.expert_params, ctx.global_params, ctx.tensor_name)
        xs = self._sparsified(deltas, ctx)
        return weighted_sum(base, [(coefs[i], xs[i]) for i in ctx.order])


class SparsifyThenConsensus(SparsifyThenSum):
    """Per-expert sparsification, then TIES sign election and disjoint mean."""

    error_bound = "consensus"
    nonnegative_weights = True

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        pass  # normalize divides by the agreeing weights: no sum to check

    def coefficient(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> list[float]:
        if global_.get("rescale") == "l1":
            return [math.inf] * len(per_expert)
        lam = abs(global_["lambda"])
        scale = [1.0 if global_["normalize"] else abs(p["weight"]) for p in per_expert]
        return [lam * s * self._gain(p, global_) for s, p in zip(scale, per_expert)]

    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        xs = self._sparsified(deltas, ctx)
        terms = [(ctx.expert_params[i]["weight"], xs[i]) for i in ctx.order]
        return sign_consensus(base, terms, ctx.global_params["normalize"], ctx.global_params["lambda"])

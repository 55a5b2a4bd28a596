"""Linear merge (``linear``) and plain average (``avg``).

    linear:  out = B + Σi ci Δi,   ci = wi / Σw          (normalize, the default)
             out = Σw * B + Σi wi Δi                     (normalize: false)
    avg:     out = B + Σi Δi / K

``linear`` is mergekit's weighted average of the models, Σ wi Ei / Σ w,
written in deltas (Ei = B + Δi); the base is not one of the averaged models
unless listed as an expert (its delta is 0 and costs no reads). With
``normalize: false`` it is mergekit's plain weighted sum Σ wi Ei.

Arithmetic: ci is computed in float64 (Σw exactly rounded, so independent of
expert order), each term ``Δi * ci`` in fp32, summed in expert-id order,
then added to B. mergekit computes Σ wi Ei then divides; the two agree to
fp32 rounding. Intentional differences: weights must be >= 0 (a weighted
average), and weights summing to 0 are a ConfigError (mergekit divides by 0).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from mergepipe.engine.operators._combine import linear_coefficients, weighted_sum
from mergepipe.engine.operators.base import BlockContext, Operator


class Linear(Operator):
    name = "linear"
    fixed_coefficient = True
    error_bound = "exact"
    expert_params = ("weight",)
    global_params = ("normalize",)
    default_overrides = {"normalize": True}
    nonnegative_weights = True

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        self.coefficient(per_expert, global_, tensor_name)

    def coefficient(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str = "this tensor"
    ) -> list[float]:
        weights = [p["weight"] for p in per_expert]
        return linear_coefficients(weights, 1.0, global_["normalize"], self.name, tensor_name)

    def base_scale(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> float:
        """Multiplier of B in the output: 1, or Σw without normalize."""
        if global_["normalize"]:
            return 1.0
        return math.fsum(p["weight"] for p in per_expert)

    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        coefs = self.coefficient(ctx.expert_params, ctx.global_params, ctx.tensor_name)
        scale = self.base_scale(ctx.expert_params, ctx.global_params)
        return weighted_sum(base, [(coefs[i], deltas[i]) for i in ctx.order], scale)


class Avg(Linear):
    name = "avg"
    expert_params = ()
    global_params = ()

    def coefficient(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str = "this tensor"
    ) -> list[float]:
        return [1.0 / len(per_expert)] * len(per_expert)

    def base_scale(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> float:
        return 1.0


LINEAR = Linear()
AVG = Avg()

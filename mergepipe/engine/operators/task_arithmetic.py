"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089).

    out = B + Σi ci Δi,   ci = λ wi            (normalize: false, the default)
                          ci = λ wi / Σw       (normalize: true)

Weights may be negative (task negation). Arithmetic: ci in float64 (Σw
exactly rounded), terms ``Δi * ci`` in fp32 summed in expert-id order.
mergekit computes (Σ wi Δi) / Σw * λ; the two agree to fp32 rounding.
Intentional difference: with normalize and Σw = 0 mergekit silently divides
by 1; here it is a ConfigError.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from mergepipe.engine.operators._combine import linear_coefficients, weighted_sum
from mergepipe.engine.operators.base import BlockContext, Operator


class TaskArithmetic(Operator):
    name = "task_arithmetic"
    fixed_coefficient = True
    error_bound = "exact"
    expert_params = ("weight",)
    global_params = ("lambda", "normalize")
    default_overrides = {"normalize": False}

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        self.coefficient(per_expert, global_, tensor_name)

    def coefficient(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str = "this tensor"
    ) -> list[float]:
        weights = [p["weight"] for p in per_expert]
        return linear_coefficients(weights, global_["lambda"], global_["normalize"], self.name, tensor_name)

    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        coefs = self.coefficient(ctx.expert_params, ctx.global_params, ctx.tensor_name)
        return weighted_sum(base, [(coefs[i], deltas[i]) for i in ctx.order])


TASK_ARITHMETIC = TaskArithmetic()

"""Linear merge (``linear``), plain average (``avg``) and task arithmetic (Ilharco et al. 2023, arXiv:2212.04089)."""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

from mergepipe.spec.operators.base import BlockContext, NoParams, Normalize, OperatorDef, ParamDef, Params, ScaledSum
from mergepipe.spec.operators.base import Tensor, TensorParams, Weighted, linear_coefficients, register
from mergepipe.spec.operators.kernels import weighted_sum

#: mergekit's linear averages the models it lists, the base too where it is one of them (spec/mergekit.py).
BASE_WEIGHT = ParamDef(
    "base_weight",
    "Linear: the base's weight among the averaged models (mergekit's linear without base_model, or with it "
    "listed among the models); 0: the base is not one of them",
    "[0, inf]",
)


class Averaged(Params):
    normalize: Normalize = True
    base_weight: Annotated[float, BASE_WEIGHT] = 0.0


@register
class LinearDef(OperatorDef):
    """``out = s B + Σi ci Δi``, ci in float64, terms summed in expert-id order.

        linear:           ci = wi / (wB + Σw), s = 1          (normalize, the default)
                          ci = wi,             s = wB + Σw    (normalize: false: mergekit's Σ wi Mi)
        avg:              ci = 1 / K,          s = 1
        task_arithmetic:  ci = λ wi (/ Σw with normalize), s = 1; weights may be negative

    ``linear`` is mergekit's weighted average of the models, Σ wi Mi / Σw, written in deltas; the base is one
    of the averaged models only with a weight wB (``base_weight``, default 0), which spec/mergekit.py sets for a
    mergekit config that averages its base. Weights summing to 0 under normalize are refused.
    """

    name = "linear"
    summary = "weighted average of the experts (and of the base, with base_weight): B + Σ wi Δi / Σw"
    expert_params: ClassVar[type[Params]] = Weighted  # avg and task_arithmetic take others
    global_params: ClassVar[type[Params]] = Averaged
    error_bound = "exact"
    nonnegative_weights = True
    delta_updatable = True

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        """The signed multiplier of each expert's delta (the base's weight counted in Σw: its Δ is 0)."""
        every = [*(e.weight for e in params.experts), params.global_.base_weight]  # + 0.0 leaves the sum as it was
        return linear_coefficients(every, 1.0, params.global_.normalize, self.name, tensor_name)[:-1]

    def base_scale(self, params: TensorParams) -> float:
        """Multiplier of B in the output: 1, or Σw (the base's weight included) without normalize."""
        if params.global_.normalize:
            return 1.0
        return math.fsum([*(e.weight for e in params.experts), params.global_.base_weight])

    def keeps_base(self, params: TensorParams) -> bool:
        return self.base_scale(params) == 1.0

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.coefficients(params, tensor_name)

    def beta(self, params: TensorParams) -> list[float]:
        return [abs(c) for c in self.coefficients(params)]

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        coefs = self.coefficients(ctx.params, ctx.tensor_name)
        return weighted_sum(base, [(coefs[i], deltas[i]) for i in ctx.order], self.base_scale(ctx.params))


@register
class AvgDef(LinearDef):
    name = "avg"
    summary = "plain average of the experts: B + Σ Δi / K"
    mergekit = False
    expert_params = NoParams
    global_params = NoParams

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        return [1.0 / len(params.experts)] * len(params.experts)

    def base_scale(self, params: TensorParams) -> float:
        return 1.0


@register
class TaskArithmeticDef(LinearDef):
    name = "task_arithmetic"
    summary = "sum of weighted task vectors: B + λ Σ wi Δi (negative weights allowed)"
    global_params = ScaledSum
    nonnegative_weights = False

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        g = params.global_
        return linear_coefficients([e.weight for e in params.experts], g.lambda_, g.normalize, self.name, tensor_name)

    def base_scale(self, params: TensorParams) -> float:
        return 1.0

    def absent_neutral(self, params: TensorParams) -> bool:
        return not params.global_.normalize  # λ wi: no sum over every expert's weight

"""NearSwap (``nearswap``): the expert's value where it is near the base's, a step toward it elsewhere."""

from __future__ import annotations

from typing import Annotated, Sequence

from mergepipe.errors import ConfigError
from mergepipe.spec.operators.base import BlockContext, MergeSpec, OperatorDef, ParamDef, Params, Tensor, TensorParams
from mergepipe.spec.operators.base import register

#: mergekit's floor on |Δ| in the division.
DISTANCE_FLOOR = 1e-6

#: mergekit's t here is a distance with no upper end (0.001 is typical), not slerp's fraction.
DISTANCE = ParamDef("t", "NearSwap: the distance |E - B| up to which the expert's value is taken", "[0, inf]")


class SwapDistance(Params):
    t: Annotated[float, DISTANCE] = 0.5


@register
class NearswapDef(OperatorDef):
    """The expert's value where it is near the base's, a step of t toward it elsewhere. With
    E = B + Δ and a distance t >= 0, element by element:

        w   = clamp(t / max(|Δ|, 1e-6), 0, 1)
        out = w E + (1 - w) B              (|out - B| = min(|Δ|, t) wherever |Δ| >= 1e-6)

    mergekit's ``nearswap`` (``base_model`` is B, the one other model the expert; ``t`` required), in its fp32
    operations and order. Each entry depends on its own Δ only: it streams, an unread block is the base's and
    |out - B| <= |Δ| bounds what it leaves out (beta 1).
    """

    name = "nearswap"
    summary = "take the expert's value where it is within t of the base's, a step of t toward it elsewhere"
    global_params = SwapDistance
    error_bound = "separable"
    min_experts = 1
    max_experts = 1

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        super().validate(spec, tensor_names, num_layers)
        if "t" not in spec.params:  # no default means anything: 0.5 would take nearly every entry whole
            raise ConfigError(
                "nearswap needs t, the distance |E - B| up to which the expert's value is taken "
                "(e.g. 0.001); mergekit requires it too"
            )

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # an unread block is the base's

    def beta(self, params: TensorParams) -> list[float]:
        return [1.0]

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        (delta,) = deltas
        if delta is None:
            return base.clone()
        weight = delta.abs().clamp_(min=DISTANCE_FLOOR).reciprocal_().mul_(ctx.params.global_.t).clamp_(0.0, 1.0)
        out = (base + delta).mul_(weight)
        return out.add_(weight.neg_().add_(1.0).mul_(base))

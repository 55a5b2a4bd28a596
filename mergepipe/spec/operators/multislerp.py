"""Multi-SLERP: barycentric interpolation of N points on the hypersphere, over whole tensors. With points
xi (each tensor one vector) and weights wi (divided by their sum with ``normalize_weights``, the default):

    ni = ||xi||,  ui = xi / (ni + eps),  m = Σ wi ui
    ||m|| < eps:  two points: out = w0 x0 + w1 x1;  more: refused (antipodal points that cancel)
    out = m / ||m|| Σ wi ni                (one point: itself)

mergekit's (goddard.blog's) multislerp without its tangent-space step, which averages to exactly 0 there.
The points are the experts' task vectors (``task_vectors: true``; result added to B), or B with
``base_weight`` and every ``B + Δi`` (mergekit without a ``base_model``); norms and sums in float64.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

from mergepipe.errors import ConfigError, EngineError
from mergepipe.spec.operators.base import BlockContext, ParamDef, Params, TensorParams, register
from mergepipe.spec.operators.kernels import BaseWeight, Spherical, TaskVectors, unchanged

if TYPE_CHECKING:
    import torch


class MultiSlerpParams(Params):
    normalize_weights: Annotated[
        bool, ParamDef("normalize_weights", "bool", "global", "Multi-SLERP: divide the weights by their sum")
    ] = True
    eps: Annotated[
        float,
        ParamDef("eps", "real", "global", "Multi-SLERP: added to each norm before dividing by it", 0.0, low_open=True),
    ] = 1e-8
    task_vectors: TaskVectors = True
    base_weight: BaseWeight = 1.0


@register
class MultiSlerpDef(Spherical):
    name = "multislerp"
    summary = "barycentric interpolation of the experts' task vectors (or of the models) on the sphere, per tensor"
    global_params = MultiSlerpParams
    budget_note = (
        "multislerp merges whole tensors, each from every expert or not at all (then it keeps the "
        "base's values: without a base_model, the first model's, times |Σw| with normalize_weights: false)"
    )

    def keeps_base(self, params: TensorParams) -> bool:
        g = params.global_  # the models themselves, unnormalised: copies of B average to |Σw|·B
        weights = [*(e.weight for e in params.experts), g.base_weight]
        return g.task_vectors or g.normalize_weights or abs(math.fsum(weights)) == 1.0

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        g = params.global_
        weights = [e.weight for e in params.experts] + ([] if g.task_vectors else [g.base_weight])
        if g.normalize_weights and len(weights) > 1 and abs(math.fsum(weights)) < 1e-8:
            raise ConfigError(
                f"multislerp: the weights sum to {math.fsum(weights)!r} for {tensor_name}, so they "
                "cannot be normalised; change the weights or set normalize_weights: false"
            )

    def kernel(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        import torch

        g = ctx.global_params
        if base.numel() == 0 or (unchanged(deltas) and self.keeps_base(ctx.params)):
            return base.clone()
        points, weights = self.points(base, deltas, ctx)
        if len(points) == 1:
            out = points[0]
        else:
            if g.normalize_weights:
                total = math.fsum(weights)  # not 0: check_tensor refused that before any I/O
                weights = [w / total for w in weights]
            norms = [float(torch.linalg.vector_norm(x, dtype=torch.float64)) for x in points]
            mean = points[0] * (weights[0] / (norms[0] + g.eps))
            for x, w, n in zip(points[1:], weights[1:], norms[1:]):
                mean = mean + x * (w / (n + g.eps))
            mean_norm = float(torch.linalg.vector_norm(mean, dtype=torch.float64))
            if mean_norm >= g.eps:
                out = mean * (math.fsum(w * n for w, n in zip(weights, norms)) / mean_norm)
            elif len(points) == 2:
                out = points[0] * weights[0] + points[1] * weights[1]
            else:
                raise EngineError(
                    f"multislerp: the weighted points of tensor {ctx.tensor_name!r} cancel out (antipodal models "
                    "whose weights balance), so their mean has no direction; change the weights"
                )
        return base + out if g.task_vectors else out

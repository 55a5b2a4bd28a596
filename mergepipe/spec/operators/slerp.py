"""SLERP between the base and one expert, over the whole tensor as one vector. With E = B + Δ, t in [0, 1]:

    cos θ = <B, E> / (||B|| ||E||)     (a norm <= 1e-8 counts as 1; clamped to [-1, 1]; float64 sums)
    |cos θ| > 0.9995 (nearly colinear):  out = B + t Δ     (lerp: B itself at t = 0 or Δ = 0)
    otherwise:                           out = B sin((1-t)θ)/sin θ + E sin(tθ)/sin θ

mergekit's ``slerp`` from ``base_model`` to the other model. Tensor-level: the angle needs whole tensors.
"""

from __future__ import annotations

import math
from typing import Annotated

from mergepipe.spec.operators.base import BlockContext, OperatorDef, ParamDef, Params, Tensor, register


#: mergekit's threshold on |cos θ| above which slerp falls back to lerp.
DOT_THRESHOLD = 0.9995
#: mergekit's guard: a norm at or below this is taken as 1.
NORM_EPS = 1e-8


class Interpolation(Params):
    t: Annotated[float, ParamDef("t", "SLERP: interpolation factor, 0 = base, 1 = expert", "[0, 1]", flag=True)] = 0.5


@register
class SlerpDef(OperatorDef):
    name = "slerp"
    summary = "spherical interpolation between the base and one expert, per tensor"
    global_params = Interpolation
    streaming = False
    min_experts = 1
    max_experts = 1

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        (delta,) = deltas
        t = ctx.global_params.t
        if delta is None:
            return base.clone()
        expert = base + delta
        nb = float(torch.linalg.vector_norm(base, dtype=torch.float64))
        ne = float(torch.linalg.vector_norm(expert, dtype=torch.float64))
        nb, ne = (nb if nb > NORM_EPS else 1.0), (ne if ne > NORM_EPS else 1.0)
        dot = min(1.0, max(-1.0, float((base * expert).sum(dtype=torch.float64)) / (nb * ne)))
        if abs(dot) > DOT_THRESHOLD:
            return base + delta * t
        theta = math.acos(dot)
        sin_theta = math.sin(theta)
        return base * (math.sin((1.0 - t) * theta) / sin_theta) + expert * (math.sin(t * theta) / sin_theta)

"""NuSLERP: spherical interpolation of two points, over whole tensors or vector by vector. With points v0,
v1 and weights w0, w1, shares pi = wi / (w0 + w1) (both 1/2 when |w0 + w1| < 1e-6), per vector pair:

    ui    = vi / max(||vi||, 1e-7);   cos θ = clamp(<u0, u1>, -1, 1)    (a zero vector: θ = π/2)
    1 - cos²θ <= 1e-16 (colinear):  out = p0 v0 + p1 v1                  (lerp)
    otherwise:                      out = v0 sin(p0 θ)/sin θ + v1 sin(p1 θ)/sin θ

The vectors are the whole tensor (``nuslerp_flatten: true``), else those along the last dimension (a
matrix's rows), or along the first with ``nuslerp_row_wise: true`` (its columns: mergekit's ``dim=0``).
The points are two experts' task vectors (``task_vectors: true``; result added to B), or B with
``base_weight`` and one expert (mergekit without a ``base_model``). Norms and dots are float64 sums of
exact products; θ and the coefficients float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from mergepipe.errors import ConfigError
from mergepipe.spec.operators.base import BlockContext, ParamDef, Params, TensorParams, register
from mergepipe.spec.operators.kernels import BaseWeight, Spherical, TaskVectors, unchanged

if TYPE_CHECKING:
    import torch

#: mergekit's floor on a vector's norm before dividing by it.
NORM_FLOOR = 1e-7
#: mergekit's colinearity test: 1 - cos²θ at or below this square.
COLINEAR_EPS = 1e-8
#: mergekit takes both shares as 1/2 when the two weights sum to less than this.
ZERO_TOTAL = 1e-6
#: Elements upcast to float64 at a time by ``dot``: a few MB, whatever the tensor.
DOT_SLICE = 1 << 18


class NuSlerpParams(Params):
    nuslerp_flatten: Annotated[
        bool,
        ParamDef(
            "nuslerp_flatten",
            "bool",
            "global",
            "NuSLERP: interpolate each tensor as one vector; false: vector by vector",
        ),
    ] = True
    nuslerp_row_wise: Annotated[
        bool,
        ParamDef(
            "nuslerp_row_wise",
            "bool",
            "global",
            "NuSLERP without flatten: the vectors along the first dimension (a matrix's columns) instead "
            "of the last (its rows)",
        ),
    ] = False
    task_vectors: TaskVectors = True
    base_weight: BaseWeight = 1.0


@register
class NuSlerpDef(Spherical):
    name = "nuslerp"
    summary = "spherical interpolation of two task vectors (or of the base and one model), per tensor or vector"
    global_params = NuSlerpParams
    min_experts = 1
    max_experts = 2
    budget_note = (
        "nuslerp merges whole tensors, whatever nuslerp_flatten says, each from every expert or not at "
        "all (then it keeps the base's values: without a base_model, the first model's)"
    )

    def _count_phrase(self) -> str:
        return "two experts (one with task_vectors: false, the base being the other point)"

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        task_vectors, n = params.global_.task_vectors, len(params.experts)
        if n != (2 if task_vectors else 1):
            points = "the task vectors of two experts" if task_vectors else "the base and one expert"
            raise ConfigError(
                f"nuslerp with task_vectors: {str(task_vectors).lower()} interpolates {points}, "
                f"got {n} expert{'s' if n > 1 else ''} for {tensor_name}"
            )

    def kernel(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        import torch

        g = ctx.global_params
        if base.numel() == 0 or unchanged(deltas):
            return base.clone()
        (v0, v1), (w0, w1) = self.points(base, deltas, ctx)
        total = w0 + w1
        p0, p1 = (0.5, 0.5) if abs(total) < ZERO_TOTAL else (w0 / total, w1 / total)
        # as a matrix whose rows (axis 1) or columns (axis 0) are the vectors
        if g.nuslerp_flatten or base.dim() <= 1:
            shape, axis = (base.numel(), 1), 0
        elif g.nuslerp_row_wise:
            shape, axis = (base.shape[0], base.numel() // base.shape[0]), 0
        else:
            shape, axis = (base.numel() // base.shape[-1], base.shape[-1]), 1
        m0, m1 = v0.reshape(shape), v1.reshape(shape)
        n0 = dot(m0, m0, axis).sqrt().clamp(min=NORM_FLOOR)
        n1 = dot(m1, m1, axis).sqrt().clamp(min=NORM_FLOOR)
        cos = (dot(m0, m1, axis) / (n0 * n1)).clamp(-1.0, 1.0)
        colinear = (1.0 - cos * cos) <= COLINEAR_EPS**2
        theta = torch.acos(torch.where(colinear, 0.0, cos))
        sin_theta = torch.where(colinear, 1.0, torch.sin(theta))
        c0 = torch.where(colinear, p0, torch.sin(theta * p0) / sin_theta).float()
        c1 = torch.where(colinear, p1, torch.sin(theta * p1) / sin_theta).float()
        out = (m0 * c0 + m1 * c1).reshape(base.shape)
        return base + out if g.task_vectors else out


def dot(a: torch.Tensor, b: torch.Tensor, axis: int) -> torch.Tensor:
    """float64 ``Σ a·b`` along ``axis`` of two matrices (kept). Every product of fp32 values is exact in
    float64, so one-element vectors get cos θ = ±1 exactly (the lerp); rows are upcast a slice at a time."""
    import torch

    step = max(1, DOT_SLICE // a.shape[1])
    sums = [
        (a[i : i + step].double() * b[i : i + step].double()).sum(dim=axis, keepdim=True)
        for i in range(0, a.shape[0], step)
    ]
    if axis == 1:
        return torch.cat(sums)
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total

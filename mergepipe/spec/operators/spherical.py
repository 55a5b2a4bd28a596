"""The means on the sphere: SLERP, NuSLERP, Multi-SLERP and the Karcher mean, each over whole tensors (an
unread tensor keeps the base's), each class's docstring its formula."""

from __future__ import annotations

import math
from typing import Annotated, Sequence

from mergepipe.errors import ConfigError, EngineError
from mergepipe.spec.operators.base import BlockContext, MergeSpec, OperatorDef, ParamDef, Params, Tensor, TensorParams
from mergepipe.spec.operators.base import Weighted, register

#: mergekit's threshold on |cos θ| above which slerp falls back to lerp.
DOT_THRESHOLD = 0.9995
#: mergekit's guard: a norm at or below this is taken as 1.
NORM_EPS = 1e-8


class Interpolation(Params):
    t: Annotated[float, ParamDef("t", "SLERP: interpolation factor, 0 = base, 1 = expert", "[0, 1]", flag=True)] = 0.5


@register
class SlerpDef(OperatorDef):
    """SLERP from B to E = B + Δ, each tensor one vector, t in [0, 1]:

    cos θ = <B, E> / (||B|| ||E||)     (a norm <= 1e-8 counts as 1; clamped to [-1, 1]; float64 sums)
    |cos θ| > 0.9995 (nearly colinear):  out = B + t Δ     (lerp: B itself at t = 0 or Δ = 0)
    otherwise:                           out = B sin((1-t)θ)/sin θ + E sin(tθ)/sin θ
    """

    name = "slerp"
    summary = "spherical interpolation between the base and one expert, per tensor"
    global_params = Interpolation
    streaming = False
    min_experts = 1
    max_experts = 1

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        (delta,) = deltas
        t = ctx.params.global_.t
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


TASK_VECTORS = ParamDef(
    "task_vectors",
    "NuSLERP, Multi-SLERP: interpolate the experts' deltas from the base (mergekit with a base_model); false: the "
    "models themselves, the base one of them (mergekit without one)",
    kind="bool",
)
TaskVectors = Annotated[bool, TASK_VECTORS]
BaseWeight = Annotated[
    float,
    ParamDef(
        "base_weight", "NuSLERP, Multi-SLERP with task_vectors false: the base's weight among the interpolated models"
    ),
]


def unchanged(deltas: list[Tensor | None]) -> bool:
    """Whether every delta is absent or zero (the mean of copies of the base is the base, exactly)."""
    return all(d is None or not bool(d.any()) for d in deltas)


class Spherical(OperatorDef):
    """NuSLERP and Multi-SLERP: the points are the task vectors (an unread one is 0) or the models."""

    expert_params = Weighted
    streaming = False
    mergekit_points = True

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        super().validate(spec, tensor_names, num_layers)
        if "base_weight" in spec.params and spec.params.get("task_vectors", True) is not False:
            raise ConfigError(
                f"{self.name}: base_weight is the base's weight among the interpolated models; "
                "it needs task_vectors: false"
            )

    def points(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> tuple[list[Tensor], list[float]]:
        """The points and their weights in summation order: the base first where it is one, then experts by id."""
        import torch

        ordered, weights = [deltas[i] for i in ctx.order], [ctx.params.experts[i].weight for i in ctx.order]
        if ctx.params.global_.task_vectors:
            return [torch.zeros_like(base) if d is None else d for d in ordered], weights
        points = [base] + [base if d is None else base + d for d in ordered]
        return points, [ctx.params.global_.base_weight, *weights]


#: mergekit's floor on a vector's norm before dividing by it.
NORM_FLOOR = 1e-7
#: mergekit's colinearity test: 1 - cos²θ at or below this square.
COLINEAR_EPS = 1e-8
#: mergekit takes both shares as 1/2 when the two weights sum to less than this.
ZERO_TOTAL = 1e-6
#: Elements upcast to float64 at a time by ``dot``: a few MB, whatever the tensor.
DOT_SLICE = 1 << 18

FLATTEN = ParamDef(
    "nuslerp_flatten", "NuSLERP: interpolate each tensor as one vector; false: vector by vector", kind="bool"
)
ROW_WISE = ParamDef(
    "nuslerp_row_wise",
    "NuSLERP without flatten: the vectors along the first dimension (a matrix's columns) instead of the last "
    "(its rows)",
    kind="bool",
)


class NuSlerpParams(Params):
    nuslerp_flatten: Annotated[bool, FLATTEN] = True
    nuslerp_row_wise: Annotated[bool, ROW_WISE] = False
    task_vectors: TaskVectors = True
    base_weight: BaseWeight = 1.0


@register
class NuSlerpDef(Spherical):
    """NuSLERP: spherical interpolation of two points, over whole tensors or vector by vector. With points v0,
    v1 and weights w0, w1, shares pi = wi / (w0 + w1) (both 1/2 when |w0 + w1| < 1e-6), per vector pair:

        ui    = vi / max(||vi||, 1e-7);   cos θ = clamp(<u0, u1>, -1, 1)    (a zero vector: θ = π/2)
        1 - cos²θ <= 1e-16 (colinear):  out = p0 v0 + p1 v1                  (lerp)
        otherwise:                      out = v0 sin(p0 θ)/sin θ + v1 sin(p1 θ)/sin θ

    The vectors are the whole tensor (``nuslerp_flatten: true``), else those along the last dimension (a
    matrix's rows), or along the first with ``nuslerp_row_wise: true`` (its columns: mergekit's ``dim=0``).
    Norms and dots are float64 sums of exact products; θ and the coefficients float64.
    """

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

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        g = ctx.params.global_
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


def dot(a: Tensor, b: Tensor, axis: int) -> Tensor:
    """float64 ``Σ a·b`` along ``axis`` of two matrices (kept), a slice of rows at a time: products of fp32
    values are exact in float64, so one-element vectors get cos θ = ±1 exactly (the lerp)."""
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


class MultiSlerpParams(Params):
    normalize_weights: Annotated[
        bool, ParamDef("normalize_weights", "Multi-SLERP: divide the weights by their sum", kind="bool")
    ] = True
    eps: Annotated[float, ParamDef("eps", "Multi-SLERP: added to each norm before dividing by it", "(0, inf]")] = 1e-8
    task_vectors: TaskVectors = True
    base_weight: BaseWeight = 1.0


@register
class MultiSlerpDef(Spherical):
    """Multi-SLERP: barycentric interpolation of N points on the hypersphere, over whole tensors. With points
    xi (each tensor one vector) and weights wi (divided by their sum with ``normalize_weights``, the default):

        ni = ||xi||,  ui = xi / (ni + eps),  m = Σ wi ui
        ||m|| < eps:  two points: out = w0 x0 + w1 x1;  more: refused (antipodal points that cancel)
        out = m / ||m|| Σ wi ni                (one point: itself)

    mergekit's (goddard.blog's) multislerp without its tangent-space step, which averages to exactly 0
    there; norms and sums in float64.
    """

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

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        g = ctx.params.global_
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


class KarcherParams(Params):
    max_iter: Annotated[int, ParamDef("max_iter", "Karcher: the most iterations of the mean", "[0, inf]", "int")] = 10
    tol: Annotated[
        float,
        ParamDef("tol", "Karcher: stop when a step is shorter; points of norm at most tol count as zero", "[0, inf]"),
    ] = 1e-5


@register
class KarcherDef(OperatorDef):
    """Karcher mean: the Riemannian mean of the models on the unit hypersphere, over whole tensors. With the
    N points B and every B + Δi (base first, then experts by id; an unread delta gives B), each one vector:

        ni = ||xi||, ui = xi / ni; the valid points have ni > tol (none: out = 0); ai = 1 / #valid
        m  = Σ ai ui / ||Σ ai ui||             (the first valid ui if that norm is < tol)
        repeat max_iter times:
            θi = 2 asin(||ui - m|| / 2) for each valid i, skipped if θi < tol
            T  = Σ ai θi / sin θi (ui - cos θi m); stop if ||T|| < tol
            m  = cos ||T|| m + sin ||T|| T / ||T||, then m / ||m|| (if ||m|| > tol)
        out = m Σ ni / N

    The angle comes from the chord, not mergekit's ``acos <m, ui>``: fine-tunes lie within ~1e-4 rad, where
    the cosine rounds to 1. Sums, angles and steps in float64.
    """

    name = "karcher"
    summary = "Riemannian (Karcher) mean of the base and the experts on the sphere, rescaled to their mean norm"
    global_params = KarcherParams
    streaming = False
    mergekit_points = True
    budget_note = (
        "karcher averages whole tensors, each from every model or not at all (then it keeps the base's "
        "values, the base being one of the averaged models)"
    )

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        g = ctx.params.global_
        if base.numel() == 0 or unchanged(deltas):
            return base.clone()
        norms: list[float] = []
        units: list[Tensor] = []  # of the valid points, in order
        for d in [None, *(deltas[i] for i in ctx.order)]:
            x = base if d is None else base + d
            norms.append(_norm(x))
            if norms[-1] > g.tol:
                units.append(x / norms[-1])
        if not units:
            return torch.zeros_like(base)
        share = 1.0 / len(units)
        mean = units[0] * share
        for u in units[1:]:
            mean = mean + u * share
        norm = _norm(mean)
        mean = units[0].clone() if norm < g.tol else mean / norm
        for _ in range(g.max_iter):
            tangent: Tensor | None = None
            for u in units:
                theta = 2.0 * math.asin(min(1.0, _norm(u - mean) / 2.0))
                if theta < g.tol:
                    continue
                step = (u - mean * math.cos(theta)) * (share * theta / math.sin(theta))
                tangent = step if tangent is None else tangent + step
            length = 0.0 if tangent is None else _norm(tangent)
            if tangent is None or length < g.tol:
                break
            mean = mean * math.cos(length) + tangent * (math.sin(length) / length)
            norm = _norm(mean)
            if norm > g.tol:
                mean = mean / norm
        return mean * (math.fsum(norms) / len(norms))


def _norm(x: Tensor) -> float:
    import torch

    return float(torch.linalg.vector_norm(x, dtype=torch.float64))

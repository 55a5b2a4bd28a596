"""Multi-SLERP: barycentric interpolation of N points on the hypersphere, over whole tensors.

With points xi (each tensor one vector) and weights wi (divided by their sum
with ``normalize_weights: true``, the default):

    ni  = ||xi||,   ui = xi / (ni + eps)
    m   = Σ wi ui                      (the weighted Euclidean mean of the unit vectors)
    ||m|| < eps:  two points: out = w0 x0 + w1 x1;  more: refused (antipodal points that cancel)
    out = m / ||m|| * Σ wi ni          (on the sphere, rescaled to the weighted mean norm)

mergekit (after goddard.blog's multislerp) then maps ``m / ||m||`` to the
tangent space there, averages the tangent vectors ``ui - <ui, m̂> m̂`` with the
weights and maps the average back with the exponential map. That average is
``m - <m, m̂> m̂ = 0`` identically, so the map back returns ``m / ||m||``: the
formula above is mergekit's without the tangent step, which in mergekit adds
only its fp32 rounding of that zero. A single point is returned as it is.

How mergekit's config maps (``spec/mergekit.py``): with a ``base_model``
(``task_vectors: true``, the default) the points are the experts' task
vectors Δi and the result is ``B + out`` (one expert: its model, ``B + Δ``);
without one the first model is MergePipe's base and the points are B itself,
weighted by ``base_weight`` (the first model's weight), and every ``B + Δi``
(``task_vectors: false``). Points are taken base first, then experts by id.

Tensor-level (``streaming = False``): the norms are the whole tensor's. A
partial budget reads a tensor of every expert or of none; a delta that
was not read counts as 0 (an unread tensor keeps the base's, or is |Σw|·B).

Intentional differences from mergekit 0.1.5: the tangent step, whose exact
value is 0, is not taken; norms and the scalar sums are float64 (mergekit
sums whole tensors in fp32: its result carries that rounding, and the fp32
rounding of the zero tangent step, both scaling the whole tensor); each
point enters the mean as ``xi * (wi / (ni + eps))``; when every delta is
zero the result is the base's bytes (mergekit refuses three or more zero
task vectors: their mean has no direction), but for the models themselves
with ``normalize_weights: false``, whose mean is then ``|Σw|·B``, computed.
"""

from __future__ import annotations

import math

import torch

from mergepipe.engine.operators._spherical import models, task_vectors, unchanged
from mergepipe.engine.operators.context import BlockContext
from mergepipe.errors import EngineError


def multislerp(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    g = ctx.global_params
    if base.numel() == 0 or (unchanged(deltas) and ctx.definition.keeps_base(ctx.params)):
        return base.clone()
    if g.task_vectors:
        points, weights = task_vectors(base, deltas, ctx)
    else:
        points, weights = models(base, deltas, ctx, g.base_weight)
    if len(points) == 1:
        out = points[0]
    else:
        if g.normalize_weights:
            total = math.fsum(weights)  # not 0: OperatorDef.check_tensor refuses it before any I/O
            weights = [w / total for w in weights]
        out = spherical_mean(points, weights, g.eps, ctx.tensor_name)
    return base + out if g.task_vectors else out


def spherical_mean(points: list[torch.Tensor], weights: list[float], eps: float, tensor_name: str) -> torch.Tensor:
    """``m / ||m|| * Σ wi ni`` (the module docstring), summed in the order given."""
    norms = [float(torch.linalg.vector_norm(x, dtype=torch.float64)) for x in points]
    mean = points[0] * (weights[0] / (norms[0] + eps))
    for x, w, n in zip(points[1:], weights[1:], norms[1:]):
        mean = mean + x * (w / (n + eps))
    mean_norm = float(torch.linalg.vector_norm(mean, dtype=torch.float64))
    if mean_norm < eps:
        if len(points) == 2:
            return points[0] * weights[0] + points[1] * weights[1]
        raise EngineError(
            f"multislerp: the weighted points of tensor {tensor_name!r} cancel out (antipodal models whose "
            "weights balance), so their mean has no direction; change the weights"
        )
    return mean * (math.fsum(w * n for w, n in zip(weights, norms)) / mean_norm)

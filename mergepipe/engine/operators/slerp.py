"""SLERP between the base and one expert, over the whole tensor as one vector.

With E = B + Δ and t in [0, 1] (0 = base, 1 = expert):

    cos θ = <B, E> / (||B|| ||E||)   (a norm <= 1e-8 counts as 1; clamped to [-1, 1])
    |cos θ| > 0.9995  (nearly colinear):  out = B + t Δ            (lerp)
    otherwise:  out = B sin((1-t)θ)/sin θ + E sin(tθ)/sin θ

This is mergekit's ``slerp`` with the base as the first endpoint (mergekit
interpolates from ``base_model`` to the other model). Tensor-level: the angle
needs whole tensors. An unread expert tensor (Δ = 0) gives B exactly.

Intentional differences from mergekit 0.1.5: norms and the dot product are
accumulated in float64 (mergekit: fp32, in chunks); the lerp branch is
written B + tΔ rather than (1-t)B + tE (equal in exact arithmetic; this form
returns B bit for bit when t = 0 or Δ = 0).
"""

from __future__ import annotations

import math

import torch

from mergepipe.engine.operators.context import BlockContext

#: mergekit's threshold on |cos θ| above which slerp falls back to lerp.
DOT_THRESHOLD = 0.9995
#: mergekit's guard: a norm at or below this is taken as 1.
NORM_EPS = 1e-8


def slerp_coefficients(base: torch.Tensor, expert: torch.Tensor, t: float) -> tuple[float, float] | None:
    """``(cB, cE)`` of ``out = cB*B + cE*E``, or None for the lerp branch."""
    nb = float(torch.linalg.vector_norm(base, dtype=torch.float64))
    ne = float(torch.linalg.vector_norm(expert, dtype=torch.float64))
    nb = nb if nb > NORM_EPS else 1.0
    ne = ne if ne > NORM_EPS else 1.0
    dot = float((base * expert).sum(dtype=torch.float64)) / (nb * ne)
    dot = min(1.0, max(-1.0, dot))
    if abs(dot) > DOT_THRESHOLD:
        return None
    theta = math.acos(dot)
    sin_theta = math.sin(theta)
    return math.sin((1.0 - t) * theta) / sin_theta, math.sin(t * theta) / sin_theta


def slerp(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    (delta,) = deltas
    t = ctx.global_params.t
    if delta is None:
        return base.clone()
    expert = base + delta
    coefs = slerp_coefficients(base, expert, t)
    if coefs is None:
        return base + delta * t
    c_base, c_expert = coefs
    return base * c_base + expert * c_expert

"""Independent float64 references of the spherical means (nuslerp, multislerp, karcher), in plain torch.

Written from the methods' definitions (mergekit's documentation, goddard.blog's multislerp, the Karcher
mean on the sphere), not from the operator code: nuslerp one vector pair at a time in a loop, multislerp
with its tangent-space step, karcher's iteration, all in float64. Points come in the order given (tests
pass experts sorted by id); parameters as plain ``{user name: value}`` dicts.
"""

from __future__ import annotations

import math

import torch


def spherical_points(base, deltas, per_expert, g):
    """float64 points and weights of nuslerp and multislerp: the task vectors, or (``task_vectors: false``)
    the base with ``base_weight`` and then every model B + Δ."""
    w = [p.get("weight", 1.0) for p in per_expert]
    if g.get("task_vectors", True):
        return [d.double() for d in deltas], w
    return [base.double()] + [(base + d).double() for d in deltas], [g.get("base_weight", 1.0)] + w


def nuslerp(base, deltas, per_expert, g):
    """NuSLERP from its definition, in float64: one vector pair at a time, in a plain loop."""
    (a, b), (wa, wb) = spherical_points(base, deltas, per_expert, g)
    total = wa + wb
    ta, tb = (0.5, 0.5) if abs(total) < 1e-6 else (wa / total, wb / total)
    shape = tuple(base.shape)
    if g.get("nuslerp_flatten", True) or base.dim() <= 1:
        rows_a, rows_b = a.reshape(1, -1), b.reshape(1, -1)
    elif g.get("nuslerp_row_wise", False):  # vectors along the first dimension: move it last
        rows_a, rows_b = (x.transpose(0, -1).reshape(-1, shape[0]) for x in (a, b))
    else:
        rows_a, rows_b = a.reshape(-1, shape[-1]), b.reshape(-1, shape[-1])
    out = torch.empty_like(rows_a)
    for r in range(rows_a.shape[0]):
        va, vb = rows_a[r], rows_b[r]
        ua, ub = va / max(va.norm().item(), 1e-7), vb / max(vb.norm().item(), 1e-7)
        cos = max(-1.0, min(1.0, (ua @ ub).item()))
        if 1 - cos * cos <= 1e-16:
            out[r] = va * ta + vb * tb
        else:
            th = math.acos(cos)
            out[r] = (va * math.sin(ta * th) + vb * math.sin(tb * th)) / math.sin(th)
    if not (g.get("nuslerp_flatten", True) or base.dim() <= 1) and g.get("nuslerp_row_wise", False):
        moved = list(shape)
        moved[0], moved[-1] = moved[-1], moved[0]
        out = out.reshape(moved).transpose(0, -1)
    out = out.reshape(shape)
    return (base.double() + out).float() if g.get("task_vectors", True) else out.float()


def multislerp(base, deltas, per_expert, g):
    """Multi-SLERP as its author defines it, in float64: project the unit vectors to the tangent space
    at their weighted mean, average there, map back with the exponential map, rescale to the mean norm."""
    points, w = spherical_points(base, deltas, per_expert, g)
    if len(points) == 1:
        out = points[0]
    else:
        eps = g.get("eps", 1e-8)
        if g.get("normalize_weights", True):
            w = [x / sum(w) for x in w]
        flats = [p.reshape(-1) for p in points]
        norms = [f.norm().item() for f in flats]
        units = [f / (n + eps) for f, n in zip(flats, norms)]
        mean = sum(x * u for x, u in zip(w, units))
        mean = mean / mean.norm()
        tangent = sum(x * (u - (u @ mean) * mean) for x, u in zip(w, units))
        length = tangent.norm().item() + eps
        on_sphere = mean * math.cos(length) + tangent * (math.sin(length) / length)
        out = (on_sphere * sum(x * n for x, n in zip(w, norms))).reshape(base.shape)
    return (base.double() + out).float() if g.get("task_vectors", True) else out.float()


def karcher(base, deltas, g):
    """The Karcher mean of the base and every B + Δ on the unit sphere (equal weights), in float64,
    rescaled to their mean norm."""
    points = [base.double().reshape(-1)] + [(base + d).double().reshape(-1) for d in deltas]
    tol, norms = g.get("tol", 1e-5), [p.norm().item() for p in points]
    units = [p / n for p, n in zip(points, norms) if n > tol]
    if not units:
        return torch.zeros_like(base)
    a = 1.0 / len(units)
    mean = sum(u * a for u in units)
    mean = units[0].clone() if mean.norm().item() < tol else mean / mean.norm()
    for _ in range(g.get("max_iter", 10)):
        tangent = torch.zeros_like(mean)
        for u in units:
            cos = max(-1.0, min(1.0, (mean @ u).item()))
            th = math.acos(cos)
            if th >= tol:
                tangent += (u - mean * cos) * (a * th / math.sin(th))
        length = tangent.norm().item()
        if length < tol:
            break
        mean = mean * math.cos(length) + tangent * (math.sin(length) / length)
        if mean.norm().item() > tol:
            mean = mean / mean.norm()
    return (mean * (sum(norms) / len(points))).reshape(base.shape).float()

"""Independent whole-tensor reference implementations, in plain torch (the spherical means in float64).

Written from the published definitions (and the methods' docstring formulas), not from the operator
code: ranks are counted by brute force (no sort, no thresholds), experts are combined with explicit
loops, nuslerp one vector pair at a time, multislerp with its tangent-space step. Experts are combined
in the order given, so tests pass them sorted by id when they compare bits.

Parameters arrive as plain ``{user name: value}`` dicts (``"lambda"``, not
``lambda_``): the tests pass the typed params' ``to_dict()``, so nothing here
depends on the package's parameter types. The random numbers of DARE and
DELLA are rebuilt here from their documented construction (``ElementRng``'s
docstring: Philox-4x64 keyed by sha256 of ``[seed, expert, tensor]``, raw
word j for element j, top 53 bits), not taken from the package's generator.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch
from numpy.random import Philox


class Uniforms:
    """The documented element-addressed uniforms of one (seed, expert, tensor)."""

    def __init__(self, seed: int, expert_id: str, tensor_name: str) -> None:
        blob = json.dumps([seed, expert_id, tensor_name]).encode()
        self.key = int.from_bytes(hashlib.sha256(blob).digest()[:16], "little")

    def uniform(self, start: int, count: int) -> torch.Tensor:
        """float64 uniforms of elements ``start .. start + count - 1``."""
        words = Philox(key=self.key).random_raw(start + count)[start:]
        top53 = np.asarray(words, dtype=np.uint64) >> np.uint64(11)
        return torch.from_numpy(top53.astype(np.float64) * 2.0**-53)


def desc_rank(values: torch.Tensor) -> torch.Tensor:
    """Rank of each entry of a 1-D tensor in a stable descending order:
    #{larger} + #{equal and earlier}. O(n^2): for small test tensors."""
    a = values.reshape(-1, 1)
    b = values.reshape(1, -1)
    n = values.numel()
    idx = torch.arange(n)
    larger = (b > a).sum(dim=1)
    equal_earlier = ((b == a) & (idx.reshape(1, -1) < idx.reshape(-1, 1))).sum(dim=1)
    return larger + equal_earlier


def topk_keep(delta: torch.Tensor, fraction: float) -> torch.Tensor:
    n = delta.numel()
    k = max(1, int(fraction * n))
    return (desc_rank(delta.reshape(-1).abs()) < k).reshape(delta.shape)


def ties_sparsify(delta: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return delta
    return torch.where(topk_keep(delta, density), delta, 0.0)


def breadcrumbs_sparsify(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    if density >= 1:
        return delta
    n = delta.numel()
    top = min(gamma, 1 - density)
    outer = min(gamma + density, 1.0)
    lo = int(top * n)
    hi = max(1, int(outer * n)) if outer < 1 else n
    rank = desc_rank(delta.reshape(-1).abs()).reshape(delta.shape)
    return torch.where((rank >= lo) & (rank < hi), delta, 0.0)


def dare_sparsify(delta, density, rng: Uniforms, rescale="inverse"):
    if density >= 1:
        return delta
    u = rng.uniform(0, delta.numel()).reshape(delta.shape)
    keep = u < density
    if rescale == "inverse":
        return torch.where(keep, delta / density, 0.0)
    kept = torch.where(keep, delta, 0.0)
    if rescale == "l1":
        before, after = delta.abs().double().sum().item(), kept.abs().double().sum().item()
        return kept if before < 1e-7 or after < 1e-7 else kept * (before / after)
    return kept


def della_sparsify(delta, density, epsilon, rng: Uniforms, rescale="inverse"):
    if density >= 1:
        return delta
    cols = math.prod(delta.shape[1:]) if delta.dim() >= 2 else delta.numel()
    rows = delta.reshape(-1, cols)
    prob = torch.empty(rows.shape, dtype=torch.float64)
    for r in range(rows.shape[0]):
        if cols == 1:
            rank = torch.full((1,), 0.5, dtype=torch.float64)
        else:
            pos = desc_rank(rows[r].abs())
            rank = (cols - 1 - pos).double() / (cols - 1)
        prob[r] = (density - epsilon) + (2.0 * epsilon) * rank
    u = rng.uniform(0, delta.numel()).reshape(rows.shape)
    keep = u < prob
    if rescale == "inverse":
        return torch.where(keep, rows / prob.float(), 0.0).reshape(delta.shape)
    kept = torch.where(keep, rows, 0.0).reshape(delta.shape)
    if rescale == "l1":
        before, after = delta.abs().double().sum().item(), kept.abs().double().sum().item()
        return kept if before < 1e-7 or after < 1e-7 else kept * (before / after)
    return kept


def linear_combine(base, coefs, xs, base_scale=1.0):
    """B*s + Σ ci xi, summed left to right."""
    acc = None
    for c, x in zip(coefs, xs):
        term = x * c
        acc = term if acc is None else acc + term
    start = base * base_scale if base_scale != 1.0 else base
    return start.clone() if acc is None else start + acc


def consensus_combine(base, weights, xs, normalize, lam):
    ys = [x * w for w, x in zip(weights, xs)]
    if not ys:
        return base.clone()
    s = ys[0]
    for y in ys[1:]:
        s = s + y
    elected = torch.where(s >= 0, 1.0, -1.0)
    agree = [torch.sign(y) == elected for y in ys]
    mixed = torch.where(agree[0], ys[0], 0.0)
    for a, y in zip(agree[1:], ys[1:]):
        mixed = mixed + torch.where(a, y, 0.0)
    if normalize:
        div = torch.where(agree[0], weights[0], 0.0)
        for a, w in zip(agree[1:], weights[1:]):
            div = div + torch.where(a, w, 0.0)
        div = torch.where(div == 0, 1.0, div)
        mixed = mixed / div
    return base + mixed * lam


def norm_coefs(weights, lam, normalize):
    total = math.fsum(weights)
    return [lam * w / total if normalize else lam * w for w in weights]


def slerp(base, delta, t):
    b = base.double().reshape(-1)
    e = (base + delta).double().reshape(-1)
    nb, ne = b.norm().item(), e.norm().item()
    nb = nb if nb > 1e-8 else 1.0
    ne = ne if ne > 1e-8 else 1.0
    dot = max(-1.0, min(1.0, (b @ e).item() / (nb * ne)))
    if abs(dot) > 0.9995:
        return base + delta * t
    th = math.acos(dot)
    return (base * (math.sin((1 - t) * th) / math.sin(th)) + (base + delta) * (math.sin(t * th) / math.sin(th)))


def model_stock(base, deltas):
    n = len(deltas)
    flats = [d.double().reshape(-1) for d in deltas]
    cos = []
    for i in range(n):
        for j in range(i + 1, n):
            c = (flats[i] @ flats[j]).item() / max(flats[i].norm().item() * flats[j].norm().item(), 1e-6)
            cos.append(max(-1.0, min(1.0, c)))
    c = sum(cos) / len(cos)
    den = 1 + (n - 1) * c
    t = 0.0 if abs(den) < 1e-6 else n * c / den
    mean = sum(deltas[1:], deltas[0].clone()) / n
    return base + mean * t


def sce_variance(deltas):
    """The population variance across the experts, as sce.py's docstring states it: float64, rounded
    to fp32."""
    return torch.var(torch.stack(deltas).double(), dim=0, unbiased=False).float()


def sce(base, deltas, select_topk):
    """SCE from its definition: the variance across the experts as the kernel's docstring states it
    (fp32, element-wise, in the given order), a brute-force stable top-k, mean-square weights in
    float64, the sign of the plain sum elected, the agreeing weighted mean in float64."""
    k_experts, n = len(deltas), base.numel()
    xs = list(deltas)
    if select_topk < 1:
        var = sce_variance(deltas)
        k = int(select_topk * int((var != 0).sum()))
        keep = (desc_rank(var.reshape(-1)) < k).reshape(var.shape)
        xs = [torch.where(keep, d, 0.0) for d in deltas]
    energy = [(x.double() ** 2).sum().item() / n for x in xs]
    total = sum(energy)
    coefs = [1.0 / k_experts] * k_experts if abs(total) < 1e-6 else [e / total for e in energy]
    s = xs[0]
    for x in xs[1:]:
        s = s + x
    agree = [torch.where(s >= 0, x > 0, x < 0).double() for x in xs]
    num = sum(c * a * x.double() for c, a, x in zip(coefs, agree, xs))
    den = sum(c * a for c, a in zip(coefs, agree))
    return (base.double() + num / den.clamp(min=1e-6)).float()


def ram_changed(deltas, epsilon):
    """The entries each expert changed (|Δ| > epsilon, else 0) and how many experts changed each entry."""
    xs = [torch.where(d.abs() > epsilon, d, torch.zeros_like(d)) for d in deltas]
    counts = torch.zeros_like(deltas[0])
    for x in xs:
        counts = counts + (x != 0).float()
    return xs, counts


def ram(base, deltas, epsilon):
    """RAM: B + Σ xi / max(c, 1), summed left to right in fp32."""
    xs, counts = ram_changed(deltas, epsilon)
    acc = xs[0] / counts.clamp(min=1)
    for x in xs[1:]:
        acc = acc + x / counts.clamp(min=1)
    return base + acc


def ramplus_tl(base, deltas, r, alpha, epsilon):
    """RAM+ (tensor-local): an expert's entries that no other expert changed scaled by
    1 + r min(shared / max(unique, epsilon), alpha); the rest as RAM."""
    xs, counts = ram_changed(deltas, epsilon)
    acc = torch.zeros_like(base)
    for x in xs:
        unique = int(((x != 0) & (counts == 1)).sum())
        shared = int(((x != 0) & (counts > 1)).sum())
        divisor = max(unique, epsilon)
        ratio = 0.0 if shared == 0 else (shared / divisor if divisor > 0 else math.inf)
        gain = 1.0 + r * min(ratio, alpha)
        acc = acc + torch.where(counts == 1, x.double() * gain, x.double() / counts.clamp(min=1)).float()
    return base + acc


def model_stock_rows(base, deltas):
    """Model stock with ``filter_wise``: one ratio per row along the last dimension, row by row in float64."""
    width = base.shape[-1] if base.dim() else 1
    b = base.reshape(-1, width)
    ds = [d.reshape(-1, width) for d in deltas]
    out = b.clone()
    for r in range(b.shape[0]):
        out[r] = model_stock(b[r], [d[r] for d in ds])
    return out.reshape(base.shape)


def arcee_importance(base, delta):
    """|Δ| times its row's KL(softmax(E_row) + 1e-8 || softmax(B_row) + 1e-8): the terms in float32 as the
    definition computes them (the kernel's documented precision, mergekit's), each row summed in float64."""
    width = base.shape[-1] if base.dim() else 1
    b = base.reshape(-1, width)
    e = (base + delta).reshape(-1, width)
    importance = torch.empty_like(b)
    for r in range(b.shape[0]):
        p = torch.softmax(e[r], dim=0) + 1e-8
        q = torch.softmax(b[r], dim=0) + 1e-8
        kl = float((p * torch.log(p / q)).double().sum())
        importance[r] = delta.reshape(-1, width)[r].abs() * torch.tensor(kl, dtype=torch.float32)
    return importance.reshape(base.shape)


def arcee_fusion(base, delta):
    """Δ kept where its importance >= median + 1.5 IQR (float32), the quantiles the sorted importances at
    index floor(q (n - 1))."""
    if base.numel() == 0:
        return base.clone()
    importance = arcee_importance(base, delta)
    ranked = importance.reshape(-1).sort().values
    n = ranked.numel()
    q1, med, q3 = (ranked[math.floor(f * (n - 1))] for f in (0.25, 0.5, 0.75))
    keep = importance >= med + 1.5 * (q3 - q1)
    return torch.where(keep, base + delta, base)


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

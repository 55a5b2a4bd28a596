"""The two ways operators combine (sparsified) expert deltas.

* ``weighted_sum``: ``B + Σ ci xi`` (task arithmetic, linear, DARE/DELLA-linear,
  breadcrumbs);
* ``sign_consensus``: TIES sign election and disjoint mean (TIES, DARE-TIES,
  breadcrumbs-TIES, DELLA), defined as

      y_i   = w_i * x_i                                  (x_i: sparsified delta)
      s     = Σ_i y_i,        elected sign  σ = +1 if s >= 0 else -1
      a_i   = [σ * y_i > 0]                              (expert i agrees, y_i != 0)
      m     = Σ_i a_i y_i
      m    /= max-or-1(Σ_i a_i w_i)                      (only with normalize;
                                                         0 agreeing weight -> 1)
      m    *= λ

  which is mergekit's ``get_mask(method="sum")`` rule: the sign of the sum of
  weighted deltas, ties (s == 0) to +.

Both take their terms in the caller's order and add them left to right in
fp32; callers pass experts sorted by id (``BlockContext.order``) so that the
bits of the result do not depend on the order experts were listed in. With
``owned`` (the engine's blocks, ``BlockContext.owns_deltas``) the consensus
scales the terms in place instead of allocating per term (on CPU a fresh
multi-MB tensor costs more than the arithmetic written into it); it still
never adds one term into another, so a NaN/Inf stays in its own expert's
tensor for ``registry.merge`` to name.
"""

from __future__ import annotations

from typing import Sequence

import torch


def weighted_sum(
    base: torch.Tensor, terms: Sequence[tuple[float, torch.Tensor | None]], base_scale: float = 1.0
) -> torch.Tensor:
    """``base * base_scale + Σ c * x`` over terms whose x is not None:
    each ``x * c`` rounded to fp32, summed left to right, then added to the
    base. No fused multiply-add: fused kernels round differently on
    different CPUs (AVX2 vs baseline builds)."""
    acc: torch.Tensor | None = None
    scratch: torch.Tensor | None = None
    for coef, x in terms:
        if x is None:
            continue
        if acc is None:
            acc = x * coef
        elif coef == 1.0:  # x * 1.0 is x, bit for bit: skip the pass
            acc.add_(x)
        else:
            scratch = x * coef if scratch is None else torch.mul(x, coef, out=scratch)
            acc.add_(scratch)
    start = base * base_scale if base_scale != 1.0 else base
    return start.clone() if acc is None else acc.add_(start)  # == start + acc (addition commutes)


def sign_consensus(
    base: torch.Tensor,
    terms: Sequence[tuple[float, torch.Tensor | None]],
    normalize: bool,
    lam: float,
    owned: bool = False,
) -> torch.Tensor:
    """``base + λ * disjoint (weighted) mean`` of the agreeing terms.

    Computed without bool masks (several times faster on CPU, where bool
    tensors take slow type-promotion paths), with the same values as the
    definition above: with ``r_i = relu(σ·y_i)`` (``|y_i|`` if expert i
    agrees, else 0), ``m = σ · Σ r_i`` and the agreeing weight is
    ``Σ w_i·sign(r_i)``. Multiplying by σ = ±1 only flips signs, which
    commutes with every rounding, so each agreeing ``y_i`` is added in the
    same order as in the definition and the bits are the same (up to the
    sign of a zero). σ is −1 where Σ y_i is −0.0, i.e. where every ``y_i``
    is a zero and no expert agrees either way.
    """
    present = [(w, x) for w, x in terms if x is not None]
    if not present:
        return base.clone()
    ys = [x if w == 1.0 else x.mul_(w) if owned else x * w for w, x in present]  # x * 1.0 is x, bit for bit
    total = ys[0] + ys[1] if len(ys) > 1 else ys[0].clone()
    for y in ys[2:]:
        total.add_(y)
    sigma = torch.copysign(total.new_ones(()), total, out=total)  # +1 / -1, in total's memory
    agreeing: torch.Tensor | None = None
    divisor: torch.Tensor | None = None
    agrees: torch.Tensor | None = None
    for (w, x), y in zip(present, ys):
        mine = owned or y is not x  # never write the caller's tensor
        r = (y.mul_(sigma) if mine else y * sigma).relu_()
        agreeing = (r.clone() if owned else r) if agreeing is None else agreeing.add_(r)
        if normalize:
            agrees = torch.sign(r, out=agrees)  # 1 where expert i agrees, else 0
            # the product in add(alpha=) is w * 0 or w * 1, exact: fused or not, the same bits
            divisor = agrees * w if divisor is None else divisor.add_(agrees, alpha=w)
    assert agreeing is not None
    if divisor is not None:
        agreeing.div_(_nonzero(divisor, [w for w, _ in present]))
    agreeing.mul_(sigma)
    return (agreeing if lam == 1.0 else agreeing.mul_(lam)).add_(base)  # == base + m·λ (addition commutes)


def _nonzero(divisor: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``divisor`` with its zeros (no agreeing weight, where the numerator is 0
    too) made nonzero, so that they divide to 0. A sum of agreeing fp32
    weights is 0 or at least the smallest positive one, so raising it to the
    smallest normal float changes only the zeros (one pass, where a mask
    costs two slow ones); weights below that fall back to the mask."""
    smallest = torch.finfo(torch.float32).tiny
    if all(w == 0 or w >= smallest for w in weights):
        return divisor.clamp_min_(smallest)
    return divisor.masked_fill_(divisor == 0, 1.0)

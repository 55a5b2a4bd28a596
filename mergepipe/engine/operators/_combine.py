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
bits of the result do not depend on the order experts were listed in.
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
        else:
            scratch = x * coef if scratch is None else torch.mul(x, coef, out=scratch)
            acc.add_(scratch)
    start = base * base_scale if base_scale != 1.0 else base
    return start.clone() if acc is None else acc.add_(start)  # == start + acc (addition commutes)


def sign_consensus(
    base: torch.Tensor, terms: Sequence[tuple[float, torch.Tensor | None]], normalize: bool, lam: float
) -> torch.Tensor:
    """``base + λ * disjoint (weighted) mean`` of the agreeing terms."""
    present = [(w, x) for w, x in terms if x is not None]
    if not present:
        return base.clone()
    ys = [x * w for w, x in present]
    total = ys[0].clone()
    for y in ys[1:]:
        total.add_(y)
    sigma = (total >= 0).to(torch.float32).mul_(2.0).sub_(1.0)  # +1 / -1, ties to +
    del total
    mixed: torch.Tensor | None = None
    divisor: torch.Tensor | None = None
    for (w, _), y in zip(present, ys):
        # masks multiply rather than torch.where: same values (inputs are
        # finite), several times faster on CPU
        agree = (y * sigma) > 0
        contrib = y.mul_(agree)
        mixed = contrib if mixed is None else mixed.add_(contrib)
        if normalize:
            weight = agree * w
            divisor = weight if divisor is None else divisor.add_(weight)
    assert mixed is not None
    if normalize:
        assert divisor is not None
        divisor = divisor.add_(divisor == 0)  # no agreeing weight: divide by 1
        mixed = mixed.div_(divisor)
    return base + mixed.mul_(lam)

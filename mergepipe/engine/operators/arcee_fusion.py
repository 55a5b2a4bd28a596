"""Arcee Fusion: keep only the expert's changes that stand out by importance, over whole tensors.

With E = B + Δ, and rows along the last dimension (a 1-D tensor is one row):

    p_r        = softmax(E_r) + 1e-8,   q_r = softmax(B_r) + 1e-8
    kl_r       = Σ_j p_rj log(p_rj / q_rj)          (how far row r's distribution moved)
    importance = |Δ| kl_r                           (each entry scaled by its row's divergence)
    threshold  = median + 1.5 (Q3 - Q1)             (the importance's quantiles over the whole tensor)
    out        = B + Δ [importance >= threshold]

A quantile is the element at index floor(q (n - 1)) of the n importances in ascending order (mergekit's
rule). This is mergekit's ``arcee_fusion``: ``base_model`` is B and the one other model is the expert
(mergekit takes exactly two inputs, the base among them; a ``base_model`` also listed under ``models``
is skipped there); it takes no parameters. Tensor-level: the threshold needs the whole tensor, so a
partial budget fuses whole tensors and keeps the others as the base's. An unread expert tensor (Δ = 0)
gives B.

The divergence's terms are computed in float32, as mergekit computes them: for a row whose
distribution barely moves they cancel, so its divergence carries float32 noise, and terms in float64
would move the mask away from mergekit's for every entry that noise carries across the threshold (see
docs/MERGEKIT.md); the row sums are accumulated in float64.

Intentional differences from mergekit 0.1.5: the quantiles are exact order statistics of the whole
tensor, where mergekit, for a tensor of more than 1M elements, takes them from 1M elements drawn at random
from the global torch generator (so two mergekit runs can differ there); the row sums in float64
(mergekit: float32), so an entry whose importance lies within that rounding of the threshold can fall on
the other side of it.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators.context import BlockContext

#: mergekit's guard added to both softmax distributions before the log.
PROBABILITY_EPS = 1e-8
#: mergekit's outlier rule: the median plus this many interquartile ranges.
IQR_FACTOR = 1.5
#: Elements per piece of rows while the divergences are computed: bounds the softmax temporaries.
PIECE_ELEMENTS = 1 << 20


def row_divergence(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """KL(softmax(E_r) + 1e-8 || softmax(B_r) + 1e-8) of each row of 2-D inputs: fp32 terms, float64 sums,
    returned in fp32 (the importance's dtype)."""
    rows, width = base.shape
    out = torch.empty(rows, dtype=torch.float64, device=base.device)
    step = max(1, PIECE_ELEMENTS // max(width, 1))
    for r0 in range(0, rows, step):
        b = base[r0 : r0 + step]
        p = torch.softmax(b + delta[r0 : r0 + step], dim=-1).add_(PROBABILITY_EPS)
        q = torch.softmax(b, dim=-1).add_(PROBABILITY_EPS)
        out[r0 : r0 + step] = (p / q).log_().mul_(p).sum(dim=-1, dtype=torch.float64)
    return out.to(torch.float32)


def outlier_threshold(importance: torch.Tensor) -> torch.Tensor:
    """median + 1.5 (Q3 - Q1) of a flat fp32 tensor, in fp32 (a 0-d tensor on its device)."""
    last = importance.numel() - 1
    q1, median, q3 = (torch.kthvalue(importance, last * k // 4 + 1).values for k in (1, 2, 3))
    return median + (q3 - q1) * IQR_FACTOR


def arcee_fusion(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    (delta,) = deltas
    if delta is None or base.numel() == 0:
        return base.clone()
    width = base.shape[-1] if base.dim() else 1
    base_rows, delta_rows = base.reshape(-1, width), delta.reshape(-1, width)
    importance = delta_rows.abs().mul_(row_divergence(base_rows, delta_rows).unsqueeze(-1)).reshape(-1)
    keep = (importance >= outlier_threshold(importance)).to(torch.float32)
    return base + delta * keep.reshape(base.shape)

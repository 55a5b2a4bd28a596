"""Arcee Fusion (``arcee_fusion``): keep only the expert's changes that stand out by importance."""

from __future__ import annotations

from mergepipe.spec.operators.base import BlockContext, OperatorDef, Tensor, register

#: mergekit's guard added to both softmax distributions before the log.
PROBABILITY_EPS = 1e-8
#: mergekit's outlier rule: the median plus this many interquartile ranges.
IQR_FACTOR = 1.5
#: Elements per piece of rows while the divergences are computed: bounds the softmax temporaries.
PIECE_ELEMENTS = 1 << 20


@register
class ArceeFusionDef(OperatorDef):
    """Keep only the expert's changes that stand out by importance, over whole tensors. With
    E = B + Δ and rows along the last dimension (a 1-D tensor is one row):

        p_r        = softmax(E_r) + 1e-8,   q_r = softmax(B_r) + 1e-8
        kl_r       = Σ_j p_rj log(p_rj / q_rj)         (terms in fp32 as mergekit's, row sums in float64)
        importance = |Δ| kl_r
        threshold  = median + 1.5 (Q3 - Q1)            (exact order statistics of the whole tensor: the
                                                        element at floor(q (n - 1)) in ascending order)
        out        = B + Δ [importance >= threshold]

    mergekit's ``arcee_fusion`` (``base_model`` is B, the one other model the expert; no parameters).
    Tensor-level: a partial budget fuses whole tensors and keeps the others as the base's.
    """

    name = "arcee_fusion"
    summary = "keep the expert's changes whose importance (|Δ| x its row's softmax KL) is an outlier, per tensor"
    streaming = False
    budget_note = (
        "arcee_fusion fuses whole tensors: each is read whole or not at all (then it keeps the base's "
        "values), since its importance threshold is a quantile of the whole tensor"
    )
    min_experts = 1
    max_experts = 1

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        import torch

        (delta,) = deltas
        if delta is None or base.numel() == 0:
            return base.clone()
        width = base.shape[-1] if base.dim() else 1
        base_rows, delta_rows = base.reshape(-1, width), delta.reshape(-1, width)
        divergence = torch.empty(base_rows.shape[0], dtype=torch.float64, device=base.device)
        step = max(1, PIECE_ELEMENTS // max(width, 1))
        for r0 in range(0, base_rows.shape[0], step):
            b = base_rows[r0 : r0 + step]
            p = torch.softmax(b + delta_rows[r0 : r0 + step], dim=-1).add_(PROBABILITY_EPS)
            q = torch.softmax(b, dim=-1).add_(PROBABILITY_EPS)
            divergence[r0 : r0 + step] = (p / q).log_().mul_(p).sum(dim=-1, dtype=torch.float64)
        importance = delta_rows.abs().mul_(divergence.to(torch.float32).unsqueeze(-1)).reshape(-1)
        last = importance.numel() - 1
        q1, median, q3 = (torch.kthvalue(importance, last * k // 4 + 1).values for k in (1, 2, 3))
        keep = (importance >= median + (q3 - q1) * IQR_FACTOR).to(torch.float32)
        return base + delta * keep.reshape(base.shape)

"""TIES merging (Yadav et al. 2023, arXiv:2306.01708)."""

from __future__ import annotations

from mergepipe.spec.operators.base import BlockContext, Density, Params, ScaledMean, Tensor, Weight, register
from mergepipe.spec.operators.kernels import SignElection, magnitude_trim


class Trimmed(Params):
    weight: Weight = 1.0
    density: Density = 1.0


@register
class TiesDef(SignElection):
    """Per expert i with density di, on a tensor of n entries:

        trim:   keep the k = max(1, int(di n)) entries of largest |Δi|, ties broken by position (a stable
                descending sort's first k); the rest become 0                        -> xi
        elect:  σ = sign(Σi wi xi), 0 -> +
        merge:  out = B + λ Σ_agreeing wi xi / Σ_agreeing wi      (the divisor only with normalize)

    Block by block the trim uses the catalog's TrimThreshold (τ, p) at di, so any block split gives the whole
    tensor's bits; a density without a stored threshold merges whole tensors. Weights must be >= 0.
    """

    name = "ties"
    summary = "trim each delta to its top density, elect signs, disjoint mean"
    expert_params = Trimmed
    global_params = ScaledMean

    def needs_thresholds(self, expert: Trimmed) -> tuple[float, ...]:
        return (expert.density,) if expert.density < 1.0 else ()

    def sparsify(self, delta: Tensor, ctx: BlockContext, expert: int) -> Tensor:
        fractions = self.needs_thresholds(ctx.params.experts[expert])
        return magnitude_trim(delta, ctx, expert, fractions[0]) if fractions else delta

"""DELLA (Deep et al. 2024, arXiv:2406.11617): ``della`` and ``della_linear``."""

from __future__ import annotations

from typing import Annotated, Sequence

from mergepipe.errors import ConfigError
from mergepipe.spec.operators.base import BlockContext, Density, ParamDef, Params, Tensor, TensorParams, Weight
from mergepipe.spec.operators.base import register
from mergepipe.spec.operators.kernels import RescaledMean, RescaledSum, SignElection, Sparsified

EPSILON = ParamDef(
    "epsilon", "DELLA: spread of keep probabilities, density +- epsilon", "[0, 0.5)", scope="expert", flag=True
)


class Magprune(Params):
    weight: Weight = 1.0
    density: Density = 1.0
    epsilon: Annotated[float, EPSILON] = 0.15


@register
class DellaLinearDef(Sparsified):
    """MAGPRUNE, a random drop whose keep probability grows with the entry's magnitude rank in its row, then
    rescale, then a weighted sum or TIES' sign election. Per expert i with density d and epsilon e (d < 1),
    per row of C entries (everything after the first dimension; a 0-d or 1-D tensor is one row):

        pos_j  = position of entry j in a stable descending sort of |Δi| in its row (0 = largest)
        r_j    = (C - 1 - pos_j) / (C - 1) in [0, 1]  (1/2 if C = 1)
        p_j    = (d - e) + 2 e r_j                     keep probability (float64)
        keep_j = u_j < p_j,  u_j: element j's uniform (``ElementRng``)
        xi_j   = Δi_j / fp32(p_j) if keep_j            (rescale: inverse, the default); Δi_j (none); l1 as DARE
        della:        out = B + sign_consensus(wi, xi, normalize, λ)
        della_linear: out = B + Σi ci xi,  ci = λ wi (/ Σw with normalize)

    Requires 0 < d - e and d + e < 1 unless d = 1 (no drop). Blocks are whole rows, so it streams (but with l1).
    """

    name = "della_linear"
    summary = "drop entries with a probability that falls with magnitude rank (MAGPRUNE), rescale, sum"
    expert_params = Magprune
    global_params = RescaledSum
    random = True

    def keep_probability(self, expert: Magprune) -> float:
        return expert.density - expert.epsilon

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.check_epsilon(params.experts, tensor_name)
        super().check_tensor(params, tensor_name)

    def check_epsilon(self, experts: Sequence[Magprune], tensor_name: str) -> None:
        for e in experts:
            d, eps = e.density, e.epsilon
            if d < 1.0 and not (d - eps > 0.0 and d + eps < 1.0):
                raise ConfigError(
                    f"{self.name}: density {d!r} +- epsilon {eps!r} must stay inside (0, 1) for {tensor_name}; "
                    "lower epsilon or move density away from 0 and 1"
                )

    def sparsify(self, delta: Tensor, ctx: BlockContext, expert: int) -> Tensor:
        import torch

        params = ctx.params.experts[expert]
        density, epsilon = params.density, params.epsilon
        if density >= 1.0 or delta.numel() == 0:
            return delta
        self.check_epsilon([params], repr(ctx.tensor_name))
        cols = ctx.row_numel
        rows = delta.reshape(-1, cols)
        # in each row's sorted order the keep probability depends on the position only: gather, scatter back
        order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
        if cols == 1:
            rank = torch.full((1,), 0.5, dtype=torch.float64, device=delta.device)
        else:
            rank = (cols - 1 - torch.arange(cols, dtype=torch.float64, device=delta.device)) / (cols - 1)
        prob = (density - epsilon) + (2.0 * epsilon) * rank
        limit = torch.ceil(prob * 2.0**53).to(torch.int64)  # u < p  <=>  53-bit integer < ceil(p 2**53)
        bits = ctx.rngs[expert].bits(ctx.flat_start, delta.numel(), device=delta.device).view(rows.shape)
        keep = bits.gather(1, order) < limit
        values = rows.gather(1, order)
        if ctx.params.global_.rescale == "inverse":
            values = values.div_(prob.to(torch.float32))
        kept = torch.empty_like(rows).scatter_(1, order, values.mul_(keep)).view(delta.shape)
        return self.rescaled(delta, kept, ctx)


@register
class DellaDef(SignElection, DellaLinearDef):
    name = "della"
    summary = "DELLA's MAGPRUNE drop, then TIES sign election"
    global_params = RescaledMean

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.check_epsilon(params.experts, tensor_name)

"""NearSwap: the expert's value where it is near the base's, a step of t toward it elsewhere.

With E = B + Δ and a distance t >= 0, element by element:

    w   = clamp(t / max(|Δ|, 1e-6), 0, 1)
    out = w E + (1 - w) B              (= B + w Δ)

so |out - B| = min(|Δ|, t) wherever |Δ| >= 1e-6: an entry within t of the base's takes the expert's value,
one further away moves t toward it. This is mergekit's ``nearswap`` (reference: the QuartetAnemoi-70B
merge): ``base_model`` is B and the one other model is the expert (mergekit takes exactly two inputs, the
base among them; a ``base_model`` also listed under ``models`` is skipped there), ``t`` the global
parameter, required as in mergekit. Each entry depends on its own Δ only, so the merge streams block by
block and a partial budget means what it means for a sum: an unread block is the base's, bit for bit,
and |out - B| <= |Δ| bounds what it leaves out (beta 1).

The float32 operations are mergekit's, in its order (t / |Δ| as torch divides a number by a tensor:
1 / |Δ|, then times t), so the result is mergekit's bit for bit. Intentional differences from mergekit
0.1.5: E is rebuilt as B + Δ from the engine's delta, which is the expert's value unless |E| is far
below |B| (where E - B rounds); an unread block is B whatever t (mergekit's formula gives B there only
for t >= 1e-6).
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators.context import BlockContext

#: mergekit's floor on |Δ| in the division (an entry this close takes the expert's value for any t >= 1e-6).
DISTANCE_FLOOR = 1e-6


def nearswap(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    (delta,) = deltas
    if delta is None:
        return base.clone()
    weight = delta.abs().clamp_(min=DISTANCE_FLOOR).reciprocal_().mul_(ctx.global_params.t).clamp_(0.0, 1.0)
    out = (base + delta).mul_(weight)
    return out.add_(weight.neg_().add_(1.0).mul_(base))

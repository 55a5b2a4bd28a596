"""Linear merge (``linear``) and plain average (``avg``).

    linear:  out = B + Σi ci Δi,   ci = wi / Σw          (normalize, the default)
             out = Σw * B + Σi wi Δi                     (normalize: false)
    avg:     out = B + Σi Δi / K

``linear`` is mergekit's weighted average of the models, Σ wi Ei / Σ w,
written in deltas (Ei = B + Δi); the base is not one of the averaged models
unless listed as an expert (its delta is 0 and costs no reads). With
``normalize: false`` it is mergekit's plain weighted sum Σ wi Ei.

Arithmetic: ci is computed in float64 (Σw exactly rounded, so independent of
expert order), each term ``Δi * ci`` in fp32, summed in expert-id order,
then added to B. mergekit computes Σ wi Ei then divides; the two agree to
fp32 rounding. Intentional differences: weights must be >= 0 (a weighted
average), and weights summing to 0 are a ConfigError (mergekit divides by 0).
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._combine import weighted_sum
from mergepipe.engine.operators.context import BlockContext
from mergepipe.spec.operators import LinearDef


def linear(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    """``s*B + Σ ci Δi`` with the definition's coefficients and base scale
    (avg and linear differ only there)."""
    definition = ctx.definition
    assert isinstance(definition, LinearDef)  # the registry runs this kernel for avg and linear only
    coefs = definition.coefficients(ctx.params, ctx.tensor_name)
    scale = definition.base_scale(ctx.params)
    return weighted_sum(base, [(coefs[i], deltas[i]) for i in ctx.order], scale)

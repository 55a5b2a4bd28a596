"""Linear merge (``linear``) and plain average (``avg``).

    linear:  out = B + Σi ci Δi,   ci = wi / (wB + Σw)   (normalize, the default)
             out = (wB + Σw) * B + Σi wi Δi             (normalize: false)
    avg:     out = B + Σi Δi / K

``linear`` is mergekit's weighted average of the models, Σ wi Mi / Σ w,
written in deltas (Mi = B + Δi); with ``normalize: false`` it is mergekit's
plain weighted sum Σ wi Mi. The base is one of the averaged models only with
a weight ``wB`` (``base_weight``, default 0: it is not): a mergekit config
whose ``linear`` has no ``base_model`` makes its first model MergePipe's base,
and one that lists its ``base_model`` among the models keeps it there; either
way that model's ``weight`` setting (a number, a gradient or filter rules,
else the global ``weight``, else 1) becomes ``base_weight``, resolved per
tensor like any setting (``spec/mergekit.py``). The base's own delta is 0, so
it adds its weight to the sum and nothing read to the plan.

Arithmetic: ci is computed in float64 (Σw exactly rounded, so independent of
expert order), each term ``Δi * ci`` in fp32, summed in expert-id order,
then added to B. mergekit computes Σ wi Mi then divides; the two agree to
fp32 rounding. Intentional differences: weights must be >= 0 (a weighted
average), and weights summing to 0 are a ConfigError (mergekit divides by 0).
A partial budget leaves blocks of an expert unread (Δi = 0 there): the exact
error bound is |ci| ||Δi|| per block.
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

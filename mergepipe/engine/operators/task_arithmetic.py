"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089).

    out = B + Σi ci Δi,   ci = λ wi            (normalize: false, the default)
                          ci = λ wi / Σw       (normalize: true)

Weights may be negative (task negation). Arithmetic: ci in float64 (Σw
exactly rounded), terms ``Δi * ci`` in fp32 summed in expert-id order.
mergekit computes (Σ wi Δi) / Σw * λ; the two agree to fp32 rounding.
Intentional difference: with normalize and Σw = 0 mergekit silently divides
by 1; here it is a ConfigError.
"""

from __future__ import annotations

import torch

from mergepipe.engine.operators._combine import weighted_sum
from mergepipe.engine.operators.context import BlockContext
from mergepipe.spec.operators import TaskArithmeticDef


def task_arithmetic(base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    definition = ctx.definition
    assert isinstance(definition, TaskArithmeticDef)  # the registry runs this kernel for task_arithmetic only
    coefs = definition.coefficients(ctx.params, ctx.tensor_name)
    return weighted_sum(base, [(coefs[i], deltas[i]) for i in ctx.order])

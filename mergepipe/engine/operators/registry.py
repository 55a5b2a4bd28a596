"""The one table of kernels, keyed like ``spec.operators.OPERATORS``, and
``merge``: the checked entry point the engine calls for every block.

``merge`` checks shapes and dtypes, then detects NaN/Inf: streaming kernels
let every input value reach the output through arithmetic (masks multiply,
NaN * 0 = NaN), so one pass over the output catches any bad input, and only
then are the inputs scanned to name the culprit; tensor-level kernels check
their inputs first.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from mergepipe.engine.operators.arcee_fusion import arcee_fusion
from mergepipe.engine.operators.breadcrumbs import breadcrumbs, breadcrumbs_ties
from mergepipe.engine.operators.context import BlockContext, all_finite, require_finite
from mergepipe.engine.operators.dare import dare_linear, dare_ties
from mergepipe.engine.operators.della import della, della_linear
from mergepipe.engine.operators.karcher import karcher
from mergepipe.engine.operators.linear import linear
from mergepipe.engine.operators.model_stock import model_stock
from mergepipe.engine.operators.multislerp import multislerp
from mergepipe.engine.operators.nearswap import nearswap
from mergepipe.engine.operators.nuslerp import nuslerp
from mergepipe.engine.operators.ram import ram, ramplus_tl
from mergepipe.engine.operators.sce import sce
from mergepipe.engine.operators.slerp import slerp
from mergepipe.engine.operators.task_arithmetic import task_arithmetic
from mergepipe.engine.operators.ties import ties
from mergepipe.errors import EngineError

#: ``kernel(base, deltas, ctx)``: the merged fp32 block (base + merged delta).
Kernel = Callable[[torch.Tensor, list[torch.Tensor | None], BlockContext], torch.Tensor]

KERNELS: dict[str, Kernel] = {
    "avg": linear,
    "linear": linear,
    "task_arithmetic": task_arithmetic,
    "ties": ties,
    "dare_linear": dare_linear,
    "dare_ties": dare_ties,
    "breadcrumbs": breadcrumbs,
    "breadcrumbs_ties": breadcrumbs_ties,
    "della": della,
    "della_linear": della_linear,
    "slerp": slerp,
    "model_stock": model_stock,
    "nearswap": nearswap,
    "arcee_fusion": arcee_fusion,
    "sce": sce,
    "ram": ram,
    "ramplus_tl": ramplus_tl,
    "nuslerp": nuslerp,
    "multislerp": multislerp,
    "karcher": karcher,
}


def merge(base: torch.Tensor, deltas: Sequence[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
    """The merged fp32 block of ``ctx``'s operator, same shape as ``base``."""
    name = ctx.definition.name
    if len(deltas) != len(ctx.expert_ids):
        raise ValueError(f"{name}: {len(deltas)} deltas for {len(ctx.expert_ids)} experts")
    if base.dtype != torch.float32:
        raise ValueError(f"{name}: base block must be float32, got {base.dtype}")
    n = base.numel()
    if ctx.row_numel and (n % ctx.row_numel or ctx.flat_start + n > ctx.numel):
        raise ValueError(
            f"{name}: block of {n} elements at row {ctx.row_start} does not fit "
            f"tensor {ctx.tensor_name!r} of shape {ctx.shape} in whole rows"
        )
    streaming = ctx.definition.streaming
    if not streaming and n != ctx.numel:
        raise ValueError(f"{name} is tensor-level: pass the whole tensor {ctx.tensor_name!r}")
    for expert_id, d in zip(ctx.expert_ids, deltas):
        if d is not None and (d.shape != base.shape or d.dtype != torch.float32 or d.device != base.device):
            raise ValueError(
                f"{name}: delta of expert {expert_id!r} is {tuple(d.shape)} {d.dtype} on {d.device}, "
                f"expected {tuple(base.shape)} float32 on {base.device}"
            )
    if not streaming:
        _require_finite_inputs(base, deltas, ctx)
    out = KERNELS[name](base, list(deltas), ctx)
    if not all_finite(out):
        _require_finite_inputs(base, deltas, ctx)
        rows = max(1, n // max(ctx.row_numel, 1))
        raise EngineError(
            f"merging tensor {ctx.tensor_name!r} (rows {ctx.row_start}..{ctx.row_start + rows - 1}) "
            f"with {name} overflowed to Inf; check the weights and lambda"
        )
    return out


def _require_finite_inputs(base: torch.Tensor, deltas: Sequence[torch.Tensor | None], ctx: BlockContext) -> None:
    require_finite(base, "the base", ctx)
    for expert_id, d in zip(ctx.expert_ids, deltas):
        if d is not None:
            require_finite(d, f"the delta of expert {expert_id!r}", ctx)
